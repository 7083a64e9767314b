"""The planner: from a recipe (no weights needed) to parameter counts, per-rank memory and a verdict.

Byte accounting (per rank):
  - routed experts: MXFP4 = 4 bits per weight + one E8M0 byte per 32 weights = exactly 4.25 bits/weight;
  - attention (KDA, MLA, indexer), dense and shared-expert weights, embeddings and lm_head: what the engine
    holds (`_class_dtype_bytes`): 2 B in GPU (bf16-compute) builds, 4 B in CPU (fp32-compute) builds, fp8
    weights included (dequantized in the graph and folded); norm and fp32 checkpoint tensors 4 B.
    Attention / dense / shared are tensor-parallel, embeddings and lm_head vocab-parallel, the rest replicated.
State, per rank: recurrent state per sequence slot (KDA state H x K x V fp32 per layer + short-conv windows
q, k, v: P x (W-1) per layer) and paged caches per token (MLA latent kv_lora_rank + qk_rope_head_dim = 576
values per MLA layer; one KV head, so replicated across attention tp; the DSA indexer keys, index_head_dim
values per indexer layer), stored in the recipe's kv_cache dtype (fp32 4 B, bf16 2 B, fp8 1 B + one E8M0
scale byte per row, `moe_export.quantize.fp8_cache`).

Engine memory, per rank (TensorRT builds; `RankPlan.memory`): the engine's activation memory (one buffer per
rank, given to its execution context with setDeviceMemoryV2; `activation_bytes`, an upper estimate from the
graph's widest per-token tensors at max_num_tokens that the build checks against TensorRT's own
device_memory_size_v2) and the plugins' scratch (`plugin_workspace_bytes`: MoE chunk buffers, DSA indexer
chunked top-k, the vocab all-gather). ONNX Runtime builds keep their temporaries within the reserve
(`workspace_reserve_gib`, which on GPUs covers the CUDA context, cuBLAS/NCCL buffers and allocator slack).

One arithmetic for pool sizes (`pool_sizes`), used by this planner, the engine loader (`engine_pool_sizes`)
and the TensorRT optimization profile: memory left after weights, engine memory and the reserve, minus
max_batch recurrent-state slots (and on a CPU target their prefix-cache state checkpoints, which share that
memory), divided by the bytes of one cache block (block_size tokens of every cache pool of the rank) = cache blocks
per pool.
Prefix-cache checkpoints: `limits.checkpoints_per_slot` x max_batch copies of one slot's recurrent state, host
memory (`checkpoint_host_bytes`): pinned beside a GPU (counted in the host peak, not the GPU's budget), the rank's
memory itself on a CPU target (`bytes_per_checkpoint`), where they leave fewer cache blocks and an engine
whose pools no longer hold one max_seq_len sequence is refused, naming the field.
Vision (K3): the tower and projector weights are replicated on every rank (class "vision", never quantized), and
one tower call's activations (`vision_activation_bytes`: a request's `limits.max_images_per_request` images at the
patch limit, spread over the attention group) must fit in the workspace reserve (the tower runs before the
prefill that uses it); without `limits.max_image_patches` the patch limit is the largest that fits.
Active parameters count the weights a token's forward pass multiplies with: every non-expert weight except
the input embedding table (a lookup), plus the top-k routed experts of each MoE layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from moe_export.common.errors import InputError
from moe_export.common.pools import GIB, EngineMemory, PoolBudget, PoolSizes, pool_sizes
from moe_export.common.model_config import ModelConfig, shipped_model_config
from moe_export.common.recipe import Recipe
from moe_export.export.plan.backend_terms import backend_terms
from moe_export.graphs.sharding import Mapping, check_divisibility, rank_numel
from moe_export.graphs.vision import (
    tower_activation_bytes,
    vision_config,
    vision_tensor_specs,
)
from moe_export.export.plan.memory import host_peak_bytes, nccl_buffer_bytes, usable_gpu_bytes
from moe_export.graphs.weights import WEIGHT_CLASSES, all_tensor_specs

MXFP4_BITS_PER_WEIGHT = 4.25
CACHE_VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}  # per cached value, by quantization.kv_cache
REPORTED_SEQUENCE_LENGTHS = (65536, 1048576)  # `plan` reports how many sequences of these lengths fit


def resolve_model_config(recipe: Recipe) -> ModelConfig:
    """Config from the checkpoint's config.json, a synthetic preset, or the recipe's shipped config."""
    src = recipe.model.source
    if src.startswith("synthetic:"):
        from moe_export.export.convert.synth import preset_config

        return preset_config(src.split(":", 1)[1])
    path = Path(src).expanduser()
    if (path / "config.json").is_file():
        return ModelConfig.from_pretrained(path)
    if recipe.model.config:
        return shipped_model_config(recipe.model.config)
    raise InputError(
        f"recipe {recipe.name}: model.source {src!r} has no config.json and model.config is not set "
        "(name a shipped config such as 'kimi-k3' to plan without the checkpoint)"
    )


def _class_dtype_bytes(recipe: Recipe, weight_class: str, stored_dtype: str) -> float:
    """Bytes per weight the built engine holds for a non-expert class (what `graphs.onnx_export` makes of it).

    The graph Casts a weight that is not stored in the type it is used in, and both ONNX Runtime and TensorRT
    fold such a Cast into a converted copy: CPU builds compute in fp32, so bf16 and fp8 weights are held as
    fp32 (4 B); GPU (TensorRT) builds compute in bf16, so bf16 weights stay 2 B and fp8 weights, dequantized by
    Cast + Mul in the graph, are folded to bf16 (2 B; keeping them 1 B needs a DequantizeLinear-based graph).
    fp32 stays fp32 where the model needs it: fp32 checkpoint tensors, norm and attention-residual weights. K3's
    vision tower graph computes in fp32 on both backends (`graphs/vision_export.py`), so its bf16 weights are
    held as fp32 by TensorRT too."""
    if stored_dtype == "F32" or weight_class in ("norms", "attn_res", "vision"):
        return 4.0
    return backend_terms(recipe).weight_bytes(recipe)


@dataclass
class RankPlan:
    rank: int
    mapping: dict
    weight_bytes: dict[str, int]
    state_bytes_per_sequence: dict[str, int]
    free_bytes: int
    max_sequences: int
    pools: PoolSizes
    memory: dict[str, int] = field(default_factory=dict)  # the GPU's budget by part (`memory_view`)
    overflow: dict[str, int] = field(default_factory=dict)
    vision_activation_bytes: int = 0
    host_bytes: dict[str, int] = field(default_factory=dict)  # host memory peaks (`memory.host_peak_bytes`)
    margin_bytes: int = 0  # bytes beyond weights, engine, reserve, max_batch slots (CPU: their checkpoints) and one max_seq_len cache

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "mapping": self.mapping,
            "weight_bytes": self.weight_bytes,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "free_bytes": self.free_bytes,
            "vision_activation_bytes": self.vision_activation_bytes,
            "margin_bytes": self.margin_bytes,
            "host_bytes": self.host_bytes,
            "max_sequences": self.max_sequences,
            "block_size": self.pools.block_size,
            "num_slots": self.pools.num_slots,
            "num_blocks": self.pools.num_blocks,
            "cache_tokens": self.pools.cache_tokens,
            "num_checkpoints": self.pools.num_checkpoints,
            "checkpoint_host_bytes": self.pools.checkpoint_host_bytes,
            "sequences_that_fit": {str(n): self.pools.sequences_that_fit(n) for n in REPORTED_SEQUENCE_LENGTHS},
            "memory": self.memory,
        }


@dataclass
class Plan:
    recipe: Recipe
    config: ModelConfig
    total_params: int
    active_params: int
    per_rank: list[RankPlan]
    memory_bytes: int
    reserve_bytes: int

    def pool_sizes(self) -> PoolSizes:
        """The pools every rank allocates: the smallest rank's (ranks run in lockstep on the same block ids)."""
        return min((r.pools for r in self.per_rank), key=lambda pools: pools.num_blocks)

    @property
    def fits(self) -> bool:
        """Every rank's pools (max_batch slots, the blocks left) hold at least one sequence of max_seq_len, and every
        node's host memory (`target.host_memory_gib`, where given) holds its ranks' run-time host memory."""
        return all(r.max_sequences >= 1 for r in self.per_rank) and self.host_fits

    def host_run_bytes_per_node(self) -> list[int]:
        """Each node's run-time host memory: its ranks' (ranks n x gpus_per_node ..) `host_bytes["run"]` summed
        (pinned prefix-cache checkpoints, one plan read chunk while loading)."""
        per_node = self.recipe.target.gpus_per_node
        return [sum(r.host_bytes.get("run", 0) for r in self.per_rank[n:n + per_node])
                for n in range(0, len(self.per_rank), per_node)]

    @property
    def host_fits(self) -> bool:
        """Every node's run-time host memory within `target.host_memory_gib` (True where it is not given)."""
        gib = self.recipe.target.host_memory_gib
        return gib is None or max(self.host_run_bytes_per_node(), default=0) <= gib * GIB

    def verdict(self) -> str:
        if not self.host_fits:
            nodes = self.host_run_bytes_per_node()
            node = max(range(len(nodes)), key=nodes.__getitem__)
            limits, per_node = self.recipe.limits, self.recipe.target.gpus_per_node
            checkpoints = sum(r.pools.checkpoint_host_bytes for r in self.per_rank[node * per_node:(node + 1) * per_node])
            return (
                f"does not fit: node {node}'s {per_node} ranks need {nodes[node] / GIB:.2f} GiB of host memory running "
                f"(pinned prefix-cache state checkpoints {checkpoints / GIB:.2f} GiB: limits.checkpoints_per_slot="
                f"{limits.checkpoints_per_slot} x max_batch={limits.max_batch} per rank; plan read buffers) but "
                f"target.host_memory_gib is {self.recipe.target.host_memory_gib:g}: lower limits.checkpoints_per_slot "
                "or limits.max_batch"
            )
        worst = min(self.per_rank, key=lambda r: r.max_sequences)
        limits = self.recipe.limits
        seq = self.recipe.limits.max_seq_len
        engine = worst.memory.get("activations", 0) + worst.memory.get("plugin_workspaces", 0)
        beside = worst.memory.get("nccl_buffers", 0) + worst.memory.get("vision_activations", 0)
        need = (worst.weight_bytes["total"] + engine + beside + self.reserve_bytes
                + worst.state_bytes_per_sequence["total"])  # fmt: skip
        if not self.fits and need <= self.memory_bytes:
            pools = worst.pools
            checkpoints = worst.memory.get("state_checkpoints", 0)
            taken = (f" and their {pools.num_checkpoints} prefix-cache state checkpoints (limits.checkpoints_per_slot="
                     f"{limits.checkpoints_per_slot}) {checkpoints / GIB:.2f} GiB" if checkpoints else "")
            return (
                f"does not fit: rank {worst.rank}: after weights, engine memory and reserve, max_batch={pools.num_slots} "
                f"recurrent-state slots take {pools.num_slots * pools.bytes_per_slot / GIB:.2f} GiB{taken} and the "
                f"cache pools hold {pools.cache_tokens} tokens, less than one sequence of {seq}: lower "
                f"{'limits.checkpoints_per_slot, ' if checkpoints else ''}limits.max_batch or limits.max_seq_len, "
                "or store the cache in fp8"
            )
        if not self.fits:
            over = need - self.memory_bytes
            biggest = max(
                (k for k in worst.weight_bytes if k != "total"), key=lambda k: worst.weight_bytes[k]
            )
            return (
                f"does not fit: rank {worst.rank} needs {need / GIB:.2f} GiB (weights "
                f"{worst.weight_bytes['total'] / GIB:.2f} GiB, largest class {biggest} "
                f"{worst.weight_bytes[biggest] / GIB:.2f} GiB; engine activations and plugin workspaces "
                f"{engine / GIB:.2f} GiB; NCCL buffers and one vision tower call ({self.recipe.limits.max_images_per_request} "
                f"image(s) at the patch limit) {beside / GIB:.2f} GiB; reserve {self.reserve_bytes / GIB:.2f} GiB; one "
                f"sequence of {seq} tokens {worst.state_bytes_per_sequence['total'] / GIB:.2f} GiB) but has "
                f"{self.memory_bytes / GIB:.2f} GiB: over by {over / GIB:.2f} GiB"
            )
        batch = self.recipe.limits.max_batch
        note = "" if worst.max_sequences >= batch else (
            f"; max_batch={batch} sequences of max_seq_len do not all fit at once (the scheduler caps "
            f"concurrent full-length sequences at {worst.max_sequences})"
        )
        return f"fits: {worst.max_sequences} sequence(s) of {seq} tokens per rank{note}"

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "model": self.config.architecture,
            "world_size": self.recipe.target.world_size,
            "tp": self.recipe.parallel.tp,
            "ep": self.recipe.parallel.ep,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "memory_bytes_per_rank": self.memory_bytes,
            "usable_gpu_bytes": self.memory_bytes,
            "margin_bytes": min(r.margin_bytes for r in self.per_rank),
            "host_peak_bytes_per_rank": max(r.host_bytes["peak"] for r in self.per_rank),
            "host_peak_bytes_per_rank_plan_buffer": max(r.host_bytes["build_plan_buffer"] for r in self.per_rank),
            "host_run_bytes_per_node": max(self.host_run_bytes_per_node(), default=0),
            "host_memory_bytes_per_node": (None if self.recipe.target.host_memory_gib is None
                                           else int(self.recipe.target.host_memory_gib * GIB)),
            "weight_bytes_per_rank": max(r.weight_bytes["total"] for r in self.per_rank),
            "reserve_bytes_per_rank": self.reserve_bytes,
            "max_seq_len": self.recipe.limits.max_seq_len,
            "fits": self.fits,
            "verdict": self.verdict(),
            "cache_tokens_per_rank": self.pool_sizes().cache_tokens,
            "sequences_that_fit": {str(n): min(r.pools.sequences_that_fit(n) for r in self.per_rank)
                                   for n in REPORTED_SEQUENCE_LENGTHS},
            "per_rank": [r.to_dict() for r in self.per_rank],
            "attention": self.recipe.parallel.attention,
            "layouts": self.layouts(),
            "dp_decode_step": self.dp_decode_step(),
        }

    def dp_decode_step(self) -> dict | None:
        """The dp layout's MoE decode-step model on rank 0 (`export/plan/decode_model.py`); None in the tp layout."""
        from moe_export.export.plan.decode_model import dp_decode_step

        if self.recipe.parallel.attention != "dp" or not self.config.num_experts:
            return None
        return dp_decode_step(self.config, self.recipe, Mapping.from_dict(self.per_rank[0].mapping))

    def layouts(self) -> dict[str, dict]:
        """Decode-step MoE bytes per GPU per MoE layer and attention work per GPU of the tp and dp layouts, at
        max_batch tokens per attention group (`export/plan/traffic.py`)."""
        from moe_export.export.plan.traffic import plan_layouts

        t = self.recipe.target
        return plan_layouts(self.config, t.world_size, self.recipe.parallel.tp, t.gpus_per_node,
                            self.recipe.limits.max_batch)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) language-model parameters; MXFP4 tensors count their logical elements."""
    total = 0
    expert_params_per_layer = 0
    non_expert = 0
    embed = 0
    moe_layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    for spec in all_tensor_specs(cfg, include_experts=False):
        non_expert += spec.numel
        if spec.weight_class == "embeddings":
            embed += spec.numel
    if cfg.num_experts:
        d, i = cfg.expert_in_dim, cfg.moe_intermediate_size
        expert_params_per_layer = 3 * d * i
    total = non_expert + moe_layers * cfg.num_experts * expert_params_per_layer
    active = non_expert - embed + moe_layers * cfg.num_experts_per_token * expert_params_per_layer
    return total, active


def recurrent_bytes_per_sequence(cfg: ModelConfig, recipe: Recipe, mapping: Mapping) -> dict[str, int]:
    """Bytes of one recurrent-state slot on this rank: KDA state (fp32) and conv windows, by kind."""
    act = 4 if recipe.target.gpu == "cpu" else 2
    n_kda = len(cfg.kda_layers)
    heads = cfg.kda_num_heads // mapping.tp
    from moe_export.plugins.gated_delta_scan.sizes import state_bytes as kda_state
    from moe_export.plugins.short_conv.sizes import state_bytes as conv_state

    return {
        "kda_state": n_kda * kda_state(heads, cfg.kda_head_dim, cfg.kda_head_dim),
        "conv_state": n_kda * 3 * conv_state(heads * cfg.kda_head_dim, cfg.conv_kernel_size, act),
    }


def cache_bytes_per_token(cfg: ModelConfig, recipe: Recipe) -> dict[str, int]:
    """Bytes one cached token takes on a rank (every MLA layer's latent row, every indexer layer's key row)."""
    from moe_export.plugins.paged_cache_write.sizes import row_bytes

    kv = recipe.quantization.kv_cache
    value, fp8 = CACHE_VALUE_BYTES[kv], kv == "fp8"
    use_indexer = cfg.has_dsa and recipe.attention.indexer == "auto"
    n_indexer = sum(1 for i in cfg.mla_layers if cfg.has_indexer(i)) if use_indexer else 0
    return {
        "mla_latent_cache": len(cfg.mla_layers) * row_bytes(cfg.latent_cache_dim, value, fp8),
        "indexer_key_cache": n_indexer * row_bytes(cfg.index_head_dim, value, fp8) if n_indexer else 0,
    }


def state_bytes_per_sequence(cfg: ModelConfig, recipe: Recipe, mapping: Mapping) -> dict[str, int]:
    """Bytes one sequence of max_seq_len tokens keeps on this rank, by kind."""
    seq = recipe.limits.max_seq_len
    out = dict(recurrent_bytes_per_sequence(cfg, recipe, mapping))
    out.update({k: v * seq for k, v in cache_bytes_per_token(cfg, recipe).items()})
    out["total"] = sum(out.values())
    return out


ACTIVATION_DTYPE_BYTES = 2  # GPU builds compute in bf16 (graphs/onnx_form.py: compute_dtype)


def activation_bytes(cfg: ModelConfig, recipe: Recipe, mapping: Mapping) -> int:
    """Upper estimate of a TensorRT engine's activation memory (device_memory_size_v2) at max_num_tokens.

    TensorRT reuses activation memory between layers, so the peak is about one layer's live tensors plus what
    crosses layers. Per token: the residual stream and its two pre-norm copies (3 x hidden, bf16); with
    attention residuals, the stacked snapshots and their normalized keys ((snapshots + 1) x hidden x 2, fp32);
    and the widest layer, each tensor counted once: MLA (q_a, q heads, absorbed q and latent output fp32,
    v_up), KDA (q/k/v projections and conv output bf16, gates and state-side fp32), MoE (router scores, choice
    and top-k fp32 over all experts; expert input and output fp32; shared / dense MLP up, gate, act bf16)."""
    t, d, a = recipe.limits.max_num_tokens, cfg.hidden_size, ACTIVATION_DTYPE_BYTES
    per_token = 3 * d * a
    if cfg.attn_res_block_size:
        snapshots = -(-cfg.num_layers // cfg.attn_res_block_size)
        per_token += 2 * (snapshots + 1) * d * 4
    heads = cfg.num_heads // mapping.tp
    mla = 0
    if cfg.mla_layers:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        mla = ((cfg.q_lora_rank or 0) * a + heads * qk * a + heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
               + heads * cfg.kv_lora_rank * 4 + heads * cfg.v_head_dim * a + cfg.latent_cache_dim * 4)
        if cfg.has_dsa:
            mla += (cfg.index_n_heads or 0) * (cfg.index_head_dim or 0) * 4 + (cfg.index_head_dim or 0) * 4
    kda = 0
    if cfg.kda_layers:
        width = (cfg.kda_num_heads // mapping.tp) * cfg.kda_head_dim
        kda = 2 * 3 * width * a + 4 * width * 4
    ffn = 2 * (cfg.intermediate_size // mapping.tp) * a + d * a
    if cfg.num_experts:
        shared = 2 * cfg.num_shared_experts * cfg.moe_intermediate_size // mapping.tp * a
        ffn = max(ffn, 3 * cfg.num_experts * 4 + 2 * cfg.expert_in_dim * 4 + shared + d * a)
    per_token += max(mla, kda) + ffn
    return int(t * per_token)


def plugin_workspace_bytes(cfg: ModelConfig, recipe: Recipe, mapping: Mapping) -> dict[str, int]:
    """Scratch the TensorRT plugins take per call at max_num_tokens (one call at a time on the rank's stream):
    MoEMXFP4 (chunked partial sums and activations, a declared plugin output in the engine's device memory, plus
    the pair layout), DSAIndexer (chunked scores and top-k merge over the tables' capacity, a declared plugin
    output too), the vocab all-gather's receive buffer, and in the dp layout the MoE all-to-all's static
    buffers (`moe_all_to_all_bytes`)."""
    from moe_export.plugins.dsa_indexer import sizes as indexer
    from moe_export.plugins.moe_mxfp4 import sizes as moe

    t = recipe.limits.max_num_tokens
    out = {}
    if cfg.num_experts:
        local = len(mapping.local_experts(cfg.num_experts))
        rows = mapping.max_recv_rows(t) if mapping.all_to_all else t  # dp: the expert op runs on the received rows
        out["moe_mxfp4"] = moe.workspace_bytes(rows, cfg.num_experts_per_token, cfg.expert_in_dim,
                                               cfg.moe_intermediate_size, local)  # fmt: skip
        if mapping.all_to_all:
            out["moe_all_to_all"] = moe_all_to_all_bytes(cfg, mapping, t)
    if cfg.has_dsa and recipe.attention.indexer == "auto":
        topk = recipe.attention.sparse_topk or cfg.index_topk
        length = -(-recipe.limits.max_seq_len // recipe.limits.block_size) * recipe.limits.block_size
        out["dsa_indexer"] = indexer.scratch_bytes(t, length, topk)  # chunk buffers: a plugin output
    if mapping.tp > 1:
        out["all_gather"] = recipe.limits.max_batch * cfg.vocab_size * 4
    return out


def moe_all_to_all_bytes(cfg: ModelConfig, mapping: Mapping, max_num_tokens: int) -> int:
    """dp layout, TensorRT: one MoE layer's all-to-all memory at the static receive bound R = `Mapping.max_recv_rows`.
    In the engine (TensorRT reuses them between layers): the received rows (bf16), their top-k ids (int64) and
    weights (fp32), the expert op's partial sums (bf16), send_rows [T * K] int64. Beside it, the plugins' torch
    temporaries at their largest (an eager prefill step, counted transport; `plugins/collectives/all_to_all.py`):
    the packed rows sent (S <= ceil(T / tp) x min(K, ep)) and received (R), and the rows sent back (S). Only the
    received rows are sent and computed; the bound is memory."""
    from moe_export.plugins.collectives.all_to_all import packed_row_bytes

    rows, d, k = mapping.max_recv_rows(max_num_tokens), cfg.expert_in_dim, cfg.num_experts_per_token
    a = ACTIVATION_DTYPE_BYTES
    share = -(-max_num_tokens // mapping.tp)
    sent = share * min(k, mapping.ep)
    engine = rows * (2 * d * a + k * (8 + 4)) + max_num_tokens * k * 8
    temporaries = (sent + rows) * packed_row_bytes(d, a, k) + sent * d * a
    return engine + temporaries


def memory_view(weights: int, pools: PoolSizes, activations: int, workspaces: dict[str, int], beside: dict[str, int],
                reserve: int, capacity: int, checkpoints: int = 0) -> dict[str, int]:  # fmt: skip
    """One GPU's (or CPU rank's) memory by part (bytes): weights, recurrent-state slots, the prefix cache's state
    checkpoints where they share this memory (`checkpoints`, CPU targets only: the row is absent otherwise), cache
    blocks, engine activations, each plugin's workspace, what runs beside the engine (`beside`: NCCL's buffers, the
    vision tower's activations), the reserve; `total` and the usable `capacity`."""
    view = {
        "weights": weights,
        "state_slots": pools.num_slots * pools.bytes_per_slot,
        **({"state_checkpoints": checkpoints} if checkpoints else {}),
        "cache_blocks": pools.num_blocks * pools.bytes_per_block,
        "activations": activations,
        **{f"workspace.{k}": v for k, v in workspaces.items()},
        "plugin_workspaces": sum(workspaces.values()),
        **beside,
        "reserve": reserve,
    }
    view["total"] = sum(v for k, v in view.items() if not k.startswith("workspace."))
    view["capacity"] = capacity
    return view


def make_plan(recipe: Recipe, cfg: ModelConfig | None = None) -> Plan:
    cfg = cfg or resolve_model_config(recipe)
    tp, ep = recipe.parallel.tp, recipe.parallel.ep
    check_divisibility(cfg, tp, ep)
    total, active = count_params(cfg)
    memory = usable_gpu_bytes(recipe)
    reserve = int(recipe.workspace_reserve_gib * GIB)
    world = recipe.target.world_size
    specs = all_tensor_specs(cfg, include_experts=False)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    vc = vision_config(cfg)
    vision_specs = vision_tensor_specs(vc) if vc is not None else []
    vision_act = vision_activation_bytes(cfg, recipe)
    per_rank = []
    for rank in range(world):
        mapping = Mapping(world, rank, tp, ep, recipe.parallel.attention)
        by_class = {c: 0.0 for c in WEIGHT_CLASSES}
        for spec in specs:
            n = rank_numel(spec, mapping, cfg.num_experts)
            by_class[spec.weight_class] += n * _class_dtype_bytes(recipe, spec.weight_class, spec.dtype)
        if cfg.num_experts:
            local = len(mapping.local_experts(cfg.num_experts))
            per_expert = 3 * cfg.expert_in_dim * cfg.moe_intermediate_size
            by_class["routed_experts"] = len(moe_layers) * local * per_expert * MXFP4_BITS_PER_WEIGHT / 8
        for spec in vision_specs:  # the tower is replicated on every rank, never quantized
            by_class["vision"] += spec.numel * _class_dtype_bytes(recipe, "vision", spec.dtype)
        weight_bytes = {c: int(math.ceil(v)) for c, v in by_class.items() if v}
        weight_bytes["total"] = sum(weight_bytes.values())
        state = state_bytes_per_sequence(cfg, recipe, mapping)
        gpu_engine = backend_terms(recipe).engine_memory
        activations = activation_bytes(cfg, recipe, mapping) if gpu_engine else 0
        workspaces = plugin_workspace_bytes(cfg, recipe, mapping) if gpu_engine else {}
        beside = {"nccl_buffers": nccl_buffer_bytes(mapping) if backend_terms(recipe).nccl else 0,
                  "vision_activations": vision_act}
        free = memory - reserve - weight_bytes["total"] - activations - sum(workspaces.values()) - sum(beside.values())
        slot_bytes = sum(recurrent_bytes_per_sequence(cfg, recipe, mapping).values())
        per_checkpoint = bytes_per_checkpoint(recipe, slot_bytes)
        pools = pool_sizes(free, block_size=recipe.limits.block_size, num_slots=recipe.limits.max_batch,
                           bytes_per_slot=slot_bytes, bytes_per_token=sum(cache_bytes_per_token(cfg, recipe).values()),
                           num_checkpoints=recipe.limits.checkpoints_per_slot * recipe.limits.max_batch,
                           bytes_per_checkpoint=per_checkpoint)
        max_seqs = pools.sequences_that_fit(recipe.limits.max_seq_len) if free >= 0 else 0
        checkpoints = pools.num_checkpoints * per_checkpoint  # of this memory (CPU targets)
        view = memory_view(weight_bytes["total"], pools, activations, workspaces, beside, reserve, memory, checkpoints)
        host = host_peak_bytes(weight_bytes["total"] - weight_bytes.get("vision", 0), pools.checkpoint_host_bytes)
        one_sequence = -(-recipe.limits.max_seq_len // pools.block_size) * pools.bytes_per_block
        margin = free - pools.num_slots * pools.bytes_per_slot - checkpoints - one_sequence
        per_rank.append(RankPlan(rank, mapping.to_dict(), weight_bytes, state, int(free), int(max_seqs), pools, view,
                                 vision_activation_bytes=vision_act, host_bytes=host, margin_bytes=int(margin)))
    return Plan(recipe, cfg, total, active, per_rank, memory, reserve)


def bytes_per_checkpoint(recipe: Recipe, bytes_per_slot: int) -> int:
    """What one prefix-cache state checkpoint (a copy of one slot's recurrent state, `bytes_per_slot`) takes of the
    memory the pools are planned in: all of it on a CPU target (every pool and checkpoint is host memory), nothing
    beside a GPU (the runners keep checkpoints in pinned host memory)."""
    return bytes_per_slot if recipe.target.gpu == "cpu" else 0


def image_patch_limit(cfg: ModelConfig, recipe: Recipe) -> int:
    """Patches one image may take: the recipe's `limits.max_image_patches` (at most the checkpoint processor's
    in_patch_limit, K3: 65536), or when it is null the largest count whose tower activations
    (`vision_activation_bytes`) fit in the workspace reserve (at least 4, one merged token)."""
    from moe_export.graphs.vision import K3_MEDIA_PROC

    ceiling = K3_MEDIA_PROC["in_patch_limit"]
    if recipe.limits.max_image_patches is not None:
        return min(ceiling, recipe.limits.max_image_patches)
    reserve = recipe.workspace_reserve_gib * GIB
    lo, hi = 4, ceiling
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _tower_bytes(cfg, recipe, mid) <= reserve else (lo, mid - 1)
    return lo


def _tower_bytes(cfg: ModelConfig, recipe: Recipe, patches: int) -> int:
    vc = vision_config(cfg)
    images = recipe.limits.max_images_per_request
    if vc is None or images == 0:
        return 0
    group = recipe.parallel.tp  # an attention group is tp ranks in both layouts
    scores = backend_terms(recipe).tower_scores  # fp32 activations on every backend (the tower graph computes in fp32)
    return tower_activation_bytes(vc, patches * -(-images // group), 4, scores_of=patches if scores else 0)


def vision_activation_bytes(cfg: ModelConfig, recipe: Recipe) -> int:
    """Activation memory the tower needs on a rank: one call over a request's images at the patch limit
    (`image_patch_limit`), spread over the attention group (each rank encodes ceil(images / group) of them;
    attention one image at a time). CPU graphs materialize each image's attention scores; GPU builds are counted
    without them (flash attention)."""
    return _tower_bytes(cfg, recipe, image_patch_limit(cfg, recipe))


def engine_pool_sizes(recipe: Recipe, cfg: ModelConfig, num_slots: int | None = None) -> PoolSizes:
    """Pool sizes of a built engine (its config.json's `recipe` and `model`): the planner's arithmetic on the
    recipe it was built from, the smallest over its ranks (ranks run in lockstep with the same block ids);
    `num_slots` overrides the recipe's max_batch."""
    if num_slots is not None:
        recipe = recipe.model_copy(update={"limits": recipe.limits.model_copy(update={"max_batch": num_slots})})
    return make_plan(recipe, cfg).pool_sizes()


def engine_memory(recipe: Recipe, cfg: ModelConfig) -> EngineMemory:
    """What the build records in config.json for the runners: each rank's pool budget and the image patch limit."""
    plan = make_plan(recipe, cfg)
    ranks = tuple(PoolBudget(r.free_bytes, r.pools.bytes_per_slot, r.pools.bytes_per_token,
                             bytes_per_checkpoint(recipe, r.pools.bytes_per_slot)) for r in plan.per_rank)
    return EngineMemory(ranks, image_patch_limit(cfg, recipe))


def reference_fp32_bytes(cfg: ModelConfig) -> int:
    """Bytes of the fp32 PyTorch reference model's weights (`moe-export generate` on a checkpoint): every
    parameter as fp32, MXFP4 experts decoded (4 B per logical weight)."""
    return count_params(cfg)[0] * 4


def available_memory_bytes() -> int:
    """Memory the OS can give this process now without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_reference_fits(cfg: ModelConfig, where: str) -> None:
    """InputError naming the memory needed when the fp32 reference model of `cfg` cannot be loaded here."""
    need, have = reference_fp32_bytes(cfg), available_memory_bytes()
    if need > have:
        raise InputError(
            f"{where}: the fp32 reference model of this {cfg.architecture} checkpoint needs {need / GIB:,.1f} GiB "
            f"of memory for its weights, {have / GIB:,.1f} GiB are available; build an engine "
            "(`moe-export build`) and generate with it instead"
        )

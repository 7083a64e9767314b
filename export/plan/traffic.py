"""Per-layout communication and attention work of one decode step (what `moe-export plan` shows for `tp` vs `dp`),
and the paper model of decode throughput built on it (README, `benchmarks/wide_ep.py --paper`).

Per decode step, each attention group decodes `batch` tokens (one per sequence); the world has `world` GPUs,
`tp` per attention group. Layouts (`graphs/sharding.py`):
  tp  one batch for the whole world: every GPU holds the same `batch` tokens; each MoE layer all-reduces the
      experts' latent partial sums [batch, d] over the ep group (NCCL ring: every GPU sends 2 (ep - 1) / ep of
      the payload; a ring spanning nodes runs at its inter-node hops' pace, so all of it is counted as
      inter-node). Tokens served per step: batch.
  dp  world / tp groups, each with its own batch: every GPU routes its share batch / tp; each token goes once to
      every distinct rank among its top-k experts' ranks (`MoEDispatch`: d activations + k int32 ids + k fp32
      weights per row), comes back as d values (`MoECombine`), and the tp group all-gathers the shares
      ((tp - 1) shares of d values sent per GPU). Tokens served per step: batch x world / tp.
The expected number of distinct ranks of a token's k experts (E experts in ep equal slices, the k chosen
uniformly without replacement) is ep x (1 - C(E - E/ep, k) / C(E, k)); the rank's own share stays local, and
of the rest (gpus_per_node - 1) / (ep - 1) goes over NVLink, the remainder between nodes. Measured routing is
not uniform (see the expert-load figures); hot experts raise the busiest rank's share, which EPLB addresses.
Activations travel in the compute dtype: bf16 on GPU (2 bytes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moe_export.common.model_config import ModelConfig

ACT_BYTES = 2  # bf16 activations on GPU
ROW_META_BYTES = 4 + 4  # per top-k choice: int32 expert id + fp32 routing weight (`plugins/collectives/all_to_all.py`)


def expected_destinations(num_experts: int, top_k: int, ep: int) -> float:
    """Expected distinct ranks holding a token's top_k experts (uniform choice without replacement)."""
    per = num_experts // ep
    if top_k > num_experts - per:
        return float(ep)
    miss = math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k)
    return ep * (1.0 - miss)


@dataclass
class LayoutTraffic:
    """One layout's decode step, per GPU: MoE bytes sent per MoE layer (by collective, and the part crossing
    nodes), attention work (token x head pairs per layer) and tokens served."""

    layout: str
    batch_per_group: int
    groups: int
    tokens_per_step: int  # distinct tokens the world decodes per step
    tokens_per_gpu: float  # of which each GPU serves
    moe_bytes: dict[str, float]  # per GPU per MoE layer: all_reduce | dispatch, combine, all_gather; total; inter_node
    attention_token_heads: int  # tokens x attention heads each GPU computes per layer
    moe_bytes_per_token: float  # total MoE bytes sent by all GPUs per MoE layer / tokens served per step

    def to_dict(self) -> dict:
        return asdict(self)


def layout_traffic(cfg: ModelConfig, layout: str, world: int, tp: int, gpus_per_node: int, batch: int,
                   act_bytes: int = ACT_BYTES) -> LayoutTraffic:
    """The decode-step figures of `layout` ("tp" or "dp") with `batch` tokens per attention group; experts over
    all `world` GPUs (ep = world)."""
    d = cfg.expert_in_dim
    heads = max(cfg.num_heads, cfg.kda_num_heads) // tp
    ep = world
    if layout == "tp":
        payload = batch * d * act_bytes
        sent = 2 * (ep - 1) * payload / ep
        # a ring spanning nodes moves at its slowest hop's pace: every byte counts at the inter-node rate
        moe = {"all_reduce": sent, "total": sent, "inter_node": sent if world > gpus_per_node else 0.0}
        return LayoutTraffic("tp", batch, 1, batch, batch / world, moe, batch * heads, sent * world / batch)
    if layout != "dp":
        raise ValueError(f"layout must be tp or dp, got {layout!r}")
    groups = world // tp
    share = batch / tp
    remote = expected_destinations(cfg.num_experts, cfg.num_experts_per_token, ep) * (ep - 1) / ep
    rows = share * remote
    dispatch = rows * (d * act_bytes + cfg.num_experts_per_token * ROW_META_BYTES) + (ep - 1) * 8  # counts first
    combine = rows * d * act_bytes
    gather = (tp - 1) * share * d * act_bytes
    off_node = (world - gpus_per_node) / max(world - 1, 1)
    total = dispatch + combine + gather
    moe = {"dispatch": dispatch, "combine": combine, "all_gather": gather, "total": total,
           "inter_node": (dispatch + combine) * off_node}
    tokens = batch * groups
    return LayoutTraffic("dp", batch, groups, tokens, tokens / world, moe, batch * heads, total * world / tokens)


def plan_layouts(cfg: ModelConfig, world: int, tp: int, gpus_per_node: int, batch: int) -> dict[str, dict]:
    """Both layouts' figures for `moe-export plan` (dp only where experts can span the world)."""
    out = {"tp": layout_traffic(cfg, "tp", world, tp, gpus_per_node, batch).to_dict()}
    if cfg.num_experts and cfg.num_experts % world == 0 and world > tp:
        out["dp"] = layout_traffic(cfg, "dp", world, tp, gpus_per_node, batch).to_dict()
    return out


# ---- paper model ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. nvlink / network: bytes per second one GPU can send (one direction)."""

    name: str
    hbm: float  # bytes / s
    flops: float  # dense bf16 FLOP / s
    nvlink: float
    network: float
    mfu: float = 0.5  # fraction of peak FLOPs the decode GEMMs reach
    hbm_efficiency: float = 0.8  # fraction of HBM bandwidth weight / state streaming reaches


H100_8X8 = Hardware("8x8 H100 SXM (NVLink 900 GB/s, 400 Gb/s per GPU between nodes)", hbm=3.35e12, flops=989e12,
                    nvlink=450e9, network=50e9)


def decode_paper_model(cfg: ModelConfig, layout: str, *, weight_bytes_per_gpu: float, expert_bytes_per_gpu: float,
                       state_bytes_per_sequence: float, cache_bytes_per_token: float, context: int, world: int,
                       tp: int, gpus_per_node: int, batch: int, hw: Hardware = H100_8X8) -> dict:
    """Decode tokens/s per GPU of a layout. Step time = memory time (weights, each sequence's recurrent state read
    and written, its cache read at `context` tokens) or compute time, whichever is longer, plus the MoE
    collectives (bandwidth terms at the slower link they cross, not overlapped with compute) and the attention /
    shared-FFN tp all-reduces inside the node (two per layer, bf16 [batch, hidden], ring)."""
    t = layout_traffic(cfg, layout, world, tp, gpus_per_node, batch)
    moe_layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    # every GPU holds its group's batch sequences' state (tp-sharded heads) in both layouts
    streamed = weight_bytes_per_gpu + batch * (2 * state_bytes_per_sequence + context * cache_bytes_per_token)
    memory_s = streamed / (hw.hbm * hw.hbm_efficiency)
    # FLOPs: non-expert weights (bf16, 2 B per parameter) on the group's batch; experts on the tokens routed here
    non_expert_params = (weight_bytes_per_gpu - expert_bytes_per_gpu) / 2
    routed_tokens = t.tokens_per_step * cfg.num_experts_per_token / world
    expert_flops = routed_tokens * moe_layers * 3 * cfg.expert_in_dim * cfg.moe_intermediate_size * 2
    compute_s = (2 * non_expert_params * batch + expert_flops) / (hw.flops * hw.mfu)
    moe = t.moe_bytes
    intra = moe["total"] - moe["inter_node"]
    moe_s = moe_layers * (moe["inter_node"] / hw.network + intra / hw.nvlink)
    tp_payload = batch * cfg.hidden_size * ACT_BYTES
    tp_s = cfg.num_layers * 2 * (2 * (tp - 1) * tp_payload / tp) / hw.nvlink if tp > 1 else 0.0
    step_s = max(memory_s, compute_s) + moe_s + tp_s
    return {"layout": layout, "batch_per_group": batch, "context": context, "tokens_per_step": t.tokens_per_step,
            "memory_ms": memory_s * 1e3, "compute_ms": compute_s * 1e3, "moe_comm_ms": moe_s * 1e3,
            "tp_comm_ms": tp_s * 1e3, "step_ms": step_s * 1e3,
            "tokens_per_s_per_gpu": t.tokens_per_step / step_s / world,
            "moe_bytes_per_gpu_per_layer": moe["total"], "moe_inter_node_bytes_per_gpu_per_layer": moe["inter_node"]}

"""Per-rank ONNX decoder graph (opset 21) with our plugin nodes and explicit collectives.

One graph per rank handles a packed batch of N sequences (prefill chunks and decode tokens mixed):

  inputs   input_ids [T] int64, positions [T] int64 (absolute position of each token in its sequence),
           (K3 with a vision tower) image_rows [M] int64 and image_embeds [M, hidden] fp32: image embeddings that
           replace those rows' input embeddings before layer 0 (`graphs.vision_export` computes them),
           cu_seqlens [N+1] int64, slot_ids [N] int64 (recurrent-state slot of each sequence),
           block_tables [N, B] int64 (each sequence's cache blocks in order, -1 padded),
           last_token_index [N] int64 (rows whose logits are wanted),
           per KDA layer i: kda_state.i [S, H_l, V, K] fp32 and conv_state.i [S, 3*P_l, W-1] fp32,
           per MLA layer i: the paged pools mla_cache.i [NB, BS, kv_lora+rope] and (DSA) index_cache.i
           [NB, BS, Di], stored in the recipe's kv_cache dtype (`cache_storage_type`; fp8 pools are uint8
           [NB, BS, D + 1]: E4M3 codes and a per-row E8M0 scale byte, see `moe_export.quantize.fp8_cache`)
  outputs  logits [N, vocab] fp32; per KDA layer the new state / conv windows of the step's N sequences
           (`kda_state.i.out` [N, H_l, V, K], `conv_state.i.out` [N, 3*P_l, W-1], row n = slot_ids[n]),
           which the runtime writes into its pools in place; per MLA layer the step's new cache rows
           (`mla_cache.i.out` [T, kv_lora+rope], `index_cache.i.out` [T, Di], fp32 values already rounded to
           the storage dtype), which the runtime writes at each token's block-table row.
  TensorRT graphs (the pools stay in place: the backend's form, `export/backends/tensorrt/graph_form.py`) take no pool
           and return none (TensorRT "may insert copies" for aliased plugin I/O): one input `pool_table` [P, 3]
           int64 holds every pool's device address
           (`plugins/pool_table.py`; the runner owns the pools, one allocation each), the pool ops name their row
           with the attribute `pool` (paged caches also `block_size`, `pool_dtype`), GatedDeltaScan / ShortConv
           update their slots in place, and a `PagedCacheWrite` per cache pool stores the step's rows, whose
           output (the rows passed on) feeds that pool's readers so that TensorRT orders them after the write.
           The pools, in table row order, are the model's metadata `pools` (name, element type, dims).

S (slots), NB (blocks) and BS (block size) are symbolic; the runtime sizes the pools (see
`moe_export.export.plan.planner.pool_sizes`). No output is a whole pool, so a step costs O(tokens + context used).

Compute dtype and pool storage: `graphs.onnx_form`. Weights are external-data initializers into the rank's
`weights.safetensors` (`graphs.onnx_builder`). The layers: `graphs.onnx_attention` (KDA, MLA, DSA indexer) and
`graphs.onnx_moe` (dense MLP, MoE).

Collectives are graph nodes `AllReduce` / `AllGather` in our domain with a `group` attribute
("tp" or "ep"): the ONNX Runtime backend splits the graph at them and the runtime performs the collective
between the segments (`moe_export.export.backends`); TensorRT engines keep them inside as NCCL plugins
(`moe_export.plugins.collectives.tensorrt_plugin`). In the `dp` layout (`graphs/sharding.py`) each MoE layer
dispatches its tokens with `MoEDispatch` and sums the experts' results with `MoECombine` (all-to-all,
`plugins/collectives/all_to_all.py`) instead of an ep all-reduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.onnx_attention import AttentionLayers
from moe_export.graphs.onnx_builder import ONNX_OPSET, GraphBuilder, graph_summary
from moe_export.graphs.onnx_form import POOL_TABLE, POOLS_KEY, GraphForm, cache_storage_type
from moe_export.graphs.onnx_moe import FeedForwardLayers
from moe_export.graphs.sharding import Mapping
from moe_export.graphs.vision import vision_config
from moe_export.graphs.weights import layer_prefix, lm_head_name, model_prefix
from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.quantize import fp8_cache
from onnx import TensorProto, helper

__all__ = ["ONNX_OPSET", "POOLS_KEY", "POOL_TABLE", "GraphBuilder", "GraphForm", "RankGraph", "export_rank_graph",
           "graph_summary"]


class RankGraph(AttentionLayers, FeedForwardLayers):
    """Emits one rank's decoder (gpt-fast style: one method per block, in forward order; the attention and FFN
    blocks live in `AttentionLayers` and `FeedForwardLayers`)."""

    def __init__(self, cfg: ModelConfig, mapping: Mapping, weights_path: Path, topk_override: int | None = None,
                 use_indexer: bool = True, kv_cache: str = "fp32", form: GraphForm = GraphForm(), limits=None):
        self.cfg, self.m = cfg, mapping
        self.limits = limits  # the recipe's limits (the form's pool lowering may size plugin workspaces with them)
        self.form = form
        self.kv_cache = kv_cache
        self.pools: list[tuple[str, int, list]] = []  # the form's pool lowering may list them: (name, type, dims)
        self.mxfp4_type = form.pools.mxfp4_type  # MXFP4 bytes (and E8M0 scales) as the MoE plugin receives them
        self.cache_type = cache_storage_type(kv_cache)
        self.g = GraphBuilder(weights_path, form.compute_dtype, form.ordered_collectives)
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.use_indexer = use_indexer and cfg.has_dsa
        self.topk = topk_override or cfg.index_topk
        self.last_indices: str | None = None  # the latest full DSA layer's top-k indices value
        self.kda_heads = cfg.kda_num_heads // mapping.tp
        self.mla_heads = cfg.num_heads // mapping.tp
        self.has_vision = vision_config(cfg) is not None  # K3 with a tower: image rows spliced in (`splice_images`)

    def row_bytes(self, dim: int) -> int:
        """Last dim of a cache pool holding rows of `dim` values: dim, or dim + 1 (the scale byte) for fp8."""
        return dim + fp8_cache.SCALE_BYTES if self.cache_type == TensorProto.UINT8 else dim

    def _input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def _output(self, value: str, name: str, elem: int, shape: list) -> None:
        self.g.op("Identity", [value], name)  # node named like the output, producing it
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def splice_images(self, h: str) -> str:
        """Inputs image_rows [M] int64 and image_embeds [M, hidden] fp32 (the vision tower's output for the step's
        `<|media_pad|>` tokens): the embeddings replace those rows of the input embeddings before layer 0."""
        g = self.g
        rows = self._input("image_rows", TensorProto.INT64, ["M"])
        embeds = g.to_act(self._input("image_embeds", TensorProto.FLOAT, ["M", self.cfg.hidden_size]), "image_embeds")
        return g.op("ScatterND", [h, g.op("Unsqueeze", [rows, g.const([-1])], "image_rows.idx"), embeds], "embed.images")

    # ---- embeddings / head (vocab-parallel) ----
    def embed(self, ids: str) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        table = g.weight(model_prefix(cfg) + "embed_tokens.weight")
        if m.tp == 1:
            return g.op("Gather", [table, ids], "embed", axis=0)
        per = cfg.vocab_size // m.tp
        local = g.op("Sub", [ids, g.const(m.tp_rank * per)], "embed.local_ids")
        inside = g.op("And", [g.op("GreaterOrEqual", [local, g.const(0)], "embed.ge"),
                              g.op("Less", [local, g.const(per)], "embed.lt")], "embed.inside")
        safe = g.op("Where", [inside, local, g.const(0)], "embed.safe_ids")
        rows = g.op("Gather", [table, safe], "embed.rows", axis=0)
        mask = g.op("Unsqueeze", [g.op("Cast", [inside], "embed.mask", to=g.act), g.const([-1])], "embed.mask2")
        return g.all_reduce(g.op("Mul", [rows, mask], "embed.partial"), "tp", m.tp, "embed.all_reduce")

    def head(self, h: str) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        normed = g.rms_norm(h, model_prefix(cfg) + "norm.weight", cfg.rms_norm_eps, "final_norm")
        name = model_prefix(cfg) + "embed_tokens.weight" if cfg.tie_word_embeddings else lm_head_name(cfg)
        logits = g.to_f32(g.linear(normed, name, "lm_head"), "lm_head")
        return logits if m.tp == 1 else g.collective("AllGather", [logits], "lm_head.all_gather", group="tp", axis=-1,
                                                   group_size=m.tp)

    # ---- attention residuals ----
    def attn_res(self, prefix: str, snaps: list[str], which: str, name: str) -> str:
        """Softmax mix over depth of [*snapshots, prefix]: keys RMS-normalized, values raw. [T, D]."""
        g = self.g
        cands = [g.op("Unsqueeze", [v, g.const([1])], f"{name}.cand{i}") for i, v in enumerate([*snaps, prefix])]
        v = g.to_f32(g.op("Concat", cands, f"{name}.stack", axis=1), f"{name}.stack")  # [T, n, D] fp32
        k = g.rms_norm(v, None, self.cfg.rms_norm_eps, f"{name}.keys", f32_in=True, f32_out=True)
        wvec = g.op("Mul", [g.weight(f"{which}_res_norm.weight", dtype=TensorProto.FLOAT),
                            g.reshape(g.weight(f"{which}_res_proj.weight", dtype=TensorProto.FLOAT), [-1],
                                      f"{name}.proj")], f"{name}.w")  # fmt: skip
        score = g.op("ReduceSum", [g.op("Mul", [k, wvec], f"{name}.kw"), g.const([-1])], f"{name}.score", keepdims=0)
        p = g.op("Unsqueeze", [g.op("Softmax", [score], f"{name}.softmax", axis=-1), g.const([-1])], f"{name}.p")
        if g.act == TensorProto.FLOAT:
            return g.op("ReduceSum", [g.op("Mul", [p, v], f"{name}.pv"), g.const([1])], name, keepdims=0)
        mixed = g.op("ReduceSum", [g.op("Mul", [p, v], f"{name}.pv"), g.const([1])], f"{name}.f32", keepdims=0)
        return g.to_act(mixed, name)

    def pool(self, name: str, elem: int, dims: list):
        """A pool of the layer, as the form reaches it: a graph input (its name) or, where the pools stay in place,
        a row of the pool table (its row index)."""
        return self.form.pools.pool(self, name, elem, dims)

    # ---- the decoder ----
    def build(self) -> onnx.ModelProto:
        """The rank's decoder over one step: inputs (`_step_inputs`, the pools), every layer, the last tokens' logits
        [N, vocab] fp32, and where the pools are graph I/O the step's new states and cache rows."""
        g, cfg = self.g, self.cfg
        ids, io_common, last = self._step_inputs()
        h = self.embed(ids)
        if self.has_vision:
            h = self.splice_images(h)
        snaps: list[str] = []
        state_outputs = []
        for i in range(cfg.num_layers):
            io = self._layer_pools(i, io_common)
            h = self._decoder_layer(i, h, snaps, io)
            for key, pool in (("state_out", f"kda_state.{i}"), ("conv_out", f"conv_state.{i}"),
                              ("mla_out", f"mla_cache.{i}"), ("index_out", f"index_cache.{i}")):
                if key in io:  # pools as graph I/O: the step's new states / rows, which the runtime writes
                    state_outputs.append((io[key], f"{pool}.out"))

        def rows(value: str, name: str) -> str:  # the rows of each sequence's last token
            return g.op("Gather", [value, last], name, axis=0)

        if cfg.attn_res_block_size is not None:
            last_snaps = [rows(s, f"final.snapshot{j}") for j, s in enumerate(snaps)]
            h = self.attn_res(rows(h, "final.prefix"), last_snaps, model_prefix(cfg) + "output_attn", "final.attn_res")
        else:
            h = rows(h, "final.last_tokens")
        self._output(self.head(h), "logits", TensorProto.FLOAT, ["N", cfg.vocab_size])
        meta = self.form.pools.finish(self)
        self._state_outputs(state_outputs)
        return self._model(meta)

    def _step_inputs(self) -> tuple[str, dict[str, str], str]:
        """(input_ids [T], the inputs every layer reads, last_token_index [N]): positions [T], cu_seqlens [N+1],
        slot_ids [N], block_tables [N, B] (with MLA layers), and local_slots [N] = 0..N-1."""
        g, i64 = self.g, TensorProto.INT64
        ids = self._input("input_ids", i64, ["T"])
        io_common = {
            "positions": self._input("positions", i64, ["T"]),
            "cu": self._input("cu_seqlens", i64, ["N_plus_1"]),
            "slots": self._input("slot_ids", i64, ["N"]),
        }
        if self.cfg.mla_layers:
            io_common["tables"] = self._input("block_tables", i64, ["N", "B"])
        last = self._input("last_token_index", i64, ["N"])
        num_seqs = g.op("Squeeze", [g.op("Shape", [io_common["slots"]], "num_seqs.shape"), g.const([0])], "num_seqs")
        io_common["local_slots"] = g.op("Range", [g.const(0), num_seqs, g.const(1)], "local_slots")  # [N] 0..N-1
        return ids, io_common, last

    def _layer_pools(self, i: int, io_common: dict[str, str]) -> dict[str, str]:
        """Layer i's inputs: the common ones and its pools (KDA state [S, H, D, D] fp32 and conv windows
        [S, 3 H D, W-1]; MLA latent cache [NB, BS, row] and the indexer's key cache)."""
        cfg, f32 = self.cfg, TensorProto.FLOAT
        io = dict(io_common)
        if cfg.is_kda(i):
            hl, dh = self.kda_heads, cfg.kda_head_dim
            io["state"] = self.pool(f"kda_state.{i}", f32, ["S", hl, dh, dh])
            io["conv"] = self.pool(f"conv_state.{i}", f32, ["S", 3 * hl * dh, cfg.conv_kernel_size - 1])
        else:
            io["mla"] = self.pool(f"mla_cache.{i}", self.cache_type, ["NB", "BS", self.row_bytes(cfg.latent_cache_dim)])
            if self.use_indexer and cfg.has_indexer(i):
                io["index"] = self.pool(f"index_cache.{i}", self.cache_type,
                                        ["NB", "BS", self.row_bytes(cfg.index_head_dim)])
        return io

    def _decoder_layer(self, i: int, h: str, snaps: list[str], io: dict[str, str]) -> str:
        """Layer i over the residual stream h [T, hidden]: attention (KDA or MLA) and FFN (MoE or dense), with
        plain residuals or, with attention residuals, over the block snapshots `snaps` (appended to here)."""
        g, cfg = self.g, self.cfg
        lp, eps = layer_prefix(cfg, i), cfg.rms_norm_eps
        attend = self.kda if cfg.is_kda(i) else self.mla
        if cfg.attn_res_block_size is None:
            a = attend(i, g.rms_norm(h, lp + "input_layernorm.weight", eps, f"layers.{i}.input_norm"), io)
            h = g.op("Add", [h, a], f"layers.{i}.attn_residual")
            mixed, prefix = h, h
        else:
            mixed = self.attn_res(h, snaps, lp + "self_attention", f"layers.{i}.attn_res") if snaps else h
            prefix = h
            if i % cfg.attn_res_block_size == 0:
                snaps.append(h)
                prefix = None
            a = attend(i, g.rms_norm(mixed, lp + "input_layernorm.weight", eps, f"layers.{i}.input_norm"), io)
            prefix = a if prefix is None else g.op("Add", [prefix, a], f"layers.{i}.attn_residual")
            mixed = self.attn_res(prefix, snaps, lp + "mlp", f"layers.{i}.mlp_res")
        x = g.rms_norm(mixed, lp + "post_attention_layernorm.weight", eps, f"layers.{i}.post_norm")
        f = self.moe(i, x) if cfg.is_moe(i) else self.mlp(x, lp + "mlp.", f"layers.{i}.mlp", self.m.tp)
        return g.op("Add", [prefix, f], f"layers.{i}.mlp_residual")

    def _state_outputs(self, state_outputs: list[tuple[str, str]]) -> None:
        """Pools as graph I/O: `<pool>.out` outputs, the step's sequences' new states [N, ...] and new cache rows
        [T, width] fp32."""
        for value, out_name in state_outputs:
            src = next(v for v in self.inputs if v.name == out_name[: -len(".out")])
            dims = [d.dim_param or d.dim_value for d in src.type.tensor_type.shape.dim]
            if out_name.startswith(("kda_state.", "conv_state.")):
                dims[0] = "N"  # the step's sequences only
            else:  # the step's new cache rows, fp32 values
                dims = ["T", self.cfg.latent_cache_dim if out_name.startswith("mla_cache.") else self.cfg.index_head_dim]
            self._output(value, out_name, TensorProto.FLOAT, dims)

    def _model(self, pool_meta: list[tuple[str, str]]) -> onnx.ModelProto:
        """The graph built so far as a model, with metadata: the rank's mapping, its weights file and what the form's
        pool lowering adds (`pool_meta`, e.g. the pool table's rows)."""
        g = self.g
        graph = helper.make_graph(g.nodes, f"rank{self.m.rank}", self.inputs, self.outputs, g.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
            producer_name="moe-export",
        )
        model.ir_version = 10
        meta = [("mapping", json.dumps(self.m.to_dict(), sort_keys=True)), ("weights", g.weights_file), *pool_meta]
        for k, v in meta:
            entry = model.metadata_props.add()
            entry.key, entry.value = k, v
        return model


def export_rank_graph(cfg: ModelConfig, recipe, mapping: Mapping, weights_path: Path, out_path: Path,
                      form: GraphForm) -> dict:
    """Write this rank's decoder graph, in the `form` its backend asks for, to `out_path` (initializers point into
    `weights_path` by file name, so both must live in the same folder). Returns a summary: op counts by type and
    plugin nodes."""
    use_indexer = recipe.attention.indexer == "auto"
    model = RankGraph(cfg, mapping, Path(weights_path), recipe.attention.sparse_topk, use_indexer,
                      recipe.quantization.kv_cache, form, limits=recipe.limits).build()
    Path(out_path).write_bytes(model.SerializeToString(deterministic=True))
    return graph_summary(model)

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
  TensorRT graphs (backend tensorrt) take no pool and return none (TensorRT "may insert
           copies" for aliased plugin I/O): one input `pool_table` [P, 3] int64 holds every pool's device address
           (`plugins/pool_table.py`; the runner owns the pools, one allocation each), the pool ops name their row
           with the attribute `pool` (paged caches also `block_size`, `pool_dtype`), GatedDeltaScan / ShortConv
           update their slots in place, and a `PagedCacheWrite` per cache pool stores the step's rows, whose
           output (the rows passed on) feeds that pool's readers so that TensorRT orders them after the write.
           The pools, in table row order, are the model's metadata `pools` (name, element type, dims).

S (slots), NB (blocks) and BS (block size) are symbolic; the runtime sizes the pools (see
`moe_export.export.planner.pool_sizes`). No output is a whole pool, so a step costs O(tokens + context used).

Compute dtype. CPU builds (backend onnxruntime) compute in fp32. GPU builds (backend tensorrt) compute in
bf16: bf16 weights are used as stored (TensorRT folds a Cast of an initializer into a converted copy, so an
fp32 graph would hold every weight in fp32), activations, GEMMs and collectives are bf16, and fp32 stays where
the model needs it: router scores (from the bf16 GEMM's logits) and top-k, KDA gates (A_log, dt_bias, decay, beta) and recurrent state, conv
taps, RMS / layer norm and attention-residual arithmetic, the plugins' fp32 inputs, caches and logits.

Weights are initializers stored as external data inside the rank's `weights.safetensors` (the
safetensors data section is raw little-endian bytes, so each initializer points at its byte range).

Collectives are graph nodes `AllReduce` / `AllGather` in our domain with a `group` attribute
("tp" or "ep"): the ONNX Runtime backend splits the graph at them and the runtime performs the collective
between the segments (`moe_export.export.backends`); TensorRT engines keep them inside as NCCL plugins
(`moe_export.plugins.collectives.tensorrt_plugin`). In the `dp` layout (`graphs/sharding.py`) each MoE layer
dispatches its tokens with `MoEDispatch` and sums the experts' results with `MoECombine` (all-to-all,
`plugins/collectives/all_to_all.py`) instead of an ep all-reduce.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.fp8_rows import round_to_fp8_rows
from moe_export.graphs.sharding import Mapping
from moe_export.graphs.vision import vision_config
from moe_export.graphs.weights import layer_prefix, lm_head_name, model_prefix
from moe_export.plugins import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from moe_export.quantize import fp8_cache
from onnx import TensorProto, helper

ONNX_OPSET = 21
# recipe kv_cache -> pool element type; fp8 pools are uint8 rows of E4M3 codes + one E8M0 scale byte
# (`moe_export.quantize.fp8_cache`), so their last dim is D + 1
CACHE_STORAGE = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "fp8": TensorProto.UINT8}
POOLS_KEY = "pools"  # TensorRT graphs' metadata: the pools in pool-table row order (name, element type, dims)
POOL_TABLE = "pool_table"  # TensorRT graphs' input [P, 3] int64 (plugins/pool_table.py)
MLA_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm
INDEXER_KNORM_EPS = 1e-6
FP8_BLOCK = 128

_TYPE_SUFFIX = {TensorProto.FLOAT: "f32", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT16: "f16"}
_SAFETENSORS_TO_ONNX = {
    "BF16": TensorProto.BFLOAT16,
    "F16": TensorProto.FLOAT16,
    "F32": TensorProto.FLOAT,
    "U8": TensorProto.UINT8,
    "I64": TensorProto.INT64,
    "F8_E4M3": TensorProto.FLOAT8E4M3FN,
}


def read_safetensors_index(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, absolute byte offset, byte length) from a safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        out[name] = (meta["dtype"], list(meta["shape"]), base + begin, end - begin)
    return out


class GraphBuilder:
    """Accumulates nodes, initializers (external, from the weights file) and small constants."""

    def __init__(self, weights_path: Path, compute_dtype: int = TensorProto.FLOAT):
        self.act = compute_dtype  # element type of activations and of weights used as stored
        self.weights_file = weights_path.name
        self.index = read_safetensors_index(weights_path)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._weights: dict[str, str] = {}
        self._consts: dict[tuple, str] = {}
        self._names: set[str] = set()

    # ---- naming ----
    def _unique(self, name: str) -> str:
        base, i = name, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    # ---- values ----
    def weight(self, name: str, as_float: bool = True, dtype: int | None = None, byte_view: int | None = None) -> str:
        """Initializer for stored tensor `name` as element type `dtype` (default: the compute dtype): float
        tensors of another type are Cast (FP8 dequantized first); as_float=False keeps the stored bytes, and
        `byte_view` (with as_float=False) declares a one-byte tensor as that one-byte element type over the same
        bytes (no conversion, no copy)."""
        target = self.act if dtype is None else dtype
        key = f"{name}|{as_float}|{target}"
        if key in self._weights:
            return self._weights[key]
        if name not in self._weights:
            dtype, shape, offset, length = self.index[name]
            elem = _SAFETENSORS_TO_ONNX[dtype]
            if byte_view is not None:
                if as_float or elem != TensorProto.UINT8 or byte_view not in (TensorProto.INT8, TensorProto.UINT8):
                    raise ValueError(f"{name}: a byte view is a uint8 tensor read as int8 or uint8")
                elem = byte_view
            t = TensorProto(name=name, data_type=elem, dims=shape)
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.weights_file), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
            self.initializers.append(t)
            self._names.add(name)
            self._weights[name] = name
        value, stored = name, self.index[name][0]
        if as_float and stored == "F8_E4M3":
            value, stored = self.fp8_dequant(name), "F32"
        if as_float and _SAFETENSORS_TO_ONNX[stored] != target:
            value = self.op("Cast", [value], f"{name}.{_TYPE_SUFFIX[target]}", to=target)
        self._weights[key] = value
        return value

    def fp8_dequant(self, name: str) -> str:
        """FP8 E4M3 weight [R, C] * its 128x128 block scales `<name>_scale_inv` [ceil(R/128), ceil(C/128)]
        -> fp32 [R, C] (scales repeated over each block, edge blocks cut to the weight's shape)."""
        rows, cols = self.index[name][1]
        scale = self.weight(name + "_scale_inv", dtype=TensorProto.FLOAT)
        gr, gc = self.index[name + "_scale_inv"][1]
        blocks = self.op("Expand", [self.reshape(scale, [gr, 1, gc, 1], f"{name}.scale4"),
                                    self.const([gr, FP8_BLOCK, gc, FP8_BLOCK])], f"{name}.scale_blocks")
        full = self.op("Slice", [self.reshape(blocks, [gr * FP8_BLOCK, gc * FP8_BLOCK], f"{name}.scale_grid"),
                                 self.const([0, 0]), self.const([rows, cols])], f"{name}.scale_full")
        return self.op("Mul", [self.op("Cast", [name], f"{name}.f32", to=TensorProto.FLOAT), full], f"{name}.dequant")

    def const(self, value, dtype=np.int64, hint: str = "const") -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._unique(f"const.{hint}")
            self.initializers.append(onnx.numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def fp8_zero_point(self) -> str:
        """A scalar float8e4m3fn zero: the zero point that makes QuantizeLinear produce E4M3 codes."""
        if ("fp8_zero",) not in self._consts:
            name = self._unique("const.fp8_zero")
            self.initializers.append(helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, [], [0.0]))
            self._consts[("fp8_zero",)] = name
        return self._consts[("fp8_zero",)]

    def const_act(self, value: float, hint: str) -> str:
        """A scalar constant of the compute dtype."""
        if self.act == TensorProto.FLOAT:
            return self.const(value, np.float32, hint)
        key = ("act", self.act, float(value))
        if key not in self._consts:
            name = self._unique(f"const.{hint}")
            self.initializers.append(helper.make_tensor(name, self.act, [], [float(value)]))
            self._consts[key] = name
        return self._consts[key]

    def to_f32(self, x: str, name: str) -> str:
        """x (compute dtype) as fp32; no node when computing in fp32."""
        return x if self.act == TensorProto.FLOAT else self.op("Cast", [x], f"{name}.f32", to=TensorProto.FLOAT)

    def to_act(self, x: str, name: str) -> str:
        """x (fp32) in the compute dtype; no node when computing in fp32."""
        return x if self.act == TensorProto.FLOAT else self.op("Cast", [x], f"{name}.act", to=self.act)

    def op(self, op_type: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "",
           out_names: dict[int, str] | None = None, **attrs):
        """Append a node named `name`; returns its output value name (or list for n_out > 1). `out_names` names
        chosen outputs by index (e.g. a graph output the node produces itself)."""
        name = self._unique(name)
        outs = [name] if n_out == 1 else [f"{name}.{i}" for i in range(n_out)]
        for index, out in (out_names or {}).items():
            outs[index] = out
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def plugin(self, op_type: str, inputs: list[str], name: str, n_out: int = 1, **attrs):
        """A node in our domain with the attributes TensorRT's ONNX parser finds the plugin by (`out_names` as
        for `op`)."""
        return self.op(op_type, inputs, name, n_out, domain=DOMAIN, plugin_version=PLUGIN_VERSION,
                       plugin_namespace=PLUGIN_NAMESPACE, **attrs)

    # ---- building blocks ----
    def linear(self, x: str, w_name: str, name: str) -> str:
        """x [T, in] @ W^T for a stored [out, in] weight -> [T, out]."""
        return self.op("Gemm", [x, self.weight(w_name)], name, transB=1)

    def rms_norm(self, x: str, w_name: str | None, eps: float, name: str, f32_in: bool = False,
                 f32_out: bool = False) -> str:  # fmt: skip
        """x * rsqrt(mean(x^2, -1) + eps) [* weight] over the last dim, in fp32; in and out in the compute
        dtype unless f32_in / f32_out."""
        x = x if f32_in else self.to_f32(x, f"{name}.in")
        ms = self.op("ReduceMean", [self.op("Mul", [x, x], f"{name}.sq"), self.const([-1])], f"{name}.ms", keepdims=1)
        rs = self.op("Sqrt", [self.op("Add", [ms, self.const(eps, np.float32, "eps")], f"{name}.add")], f"{name}.rms")
        y = self.op("Div", [x, rs], f"{name}.normed")
        final = f32_out or self.act == TensorProto.FLOAT  # the Mul produces the result itself
        if w_name:
            y = self.op("Mul", [y, self.weight(w_name, dtype=TensorProto.FLOAT)], name if final else f"{name}.f32")
        return y if f32_out else self.to_act(y, name)

    def sigmoid_mul(self, x: str, gate: str, name: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [gate], f"{name}.sigmoid")], name)

    def gated_act(self, gate: str, up: str, cfg: ModelConfig, name: str) -> str:
        """SwiGLU silu(gate) * up, or SiTU: beta*tanh(gate/beta)*sigmoid(gate) * lin*tanh(up/lin)."""
        if cfg.hidden_act == "silu":
            return self.op("Mul", [self.sigmoid_mul(gate, gate, f"{name}.silu"), up], name)
        beta = self.const_act(cfg.situ_beta, "situ_beta")
        capped = self.op("Mul", [self.op("Tanh", [self.op("Div", [gate, beta], f"{name}.gdiv")], f"{name}.gtanh"), beta], f"{name}.gcap")
        a = self.sigmoid_mul(capped, gate, f"{name}.a")
        if cfg.situ_linear_beta is not None:
            lin = self.const_act(cfg.situ_linear_beta, "situ_linear_beta")
            up = self.op("Mul", [self.op("Tanh", [self.op("Div", [up, lin], f"{name}.udiv")], f"{name}.utanh"), lin], f"{name}.ucap")
        return self.op("Mul", [a, up], name)

    def reshape(self, x: str, shape: list[int], name: str) -> str:
        return self.op("Reshape", [x, self.const(shape)], name)

    def slice_last(self, x: str, start: int, end: int, name: str) -> str:
        return self.op("Slice", [x, self.const([start]), self.const([end]), self.const([-1])], name)

    def all_reduce(self, x: str, group: str, size: int, name: str) -> str:
        return x if size == 1 else self.plugin("AllReduce", [x], name, group=group, reduce_op="sum")


@dataclass(frozen=True)
class GraphForm:
    """What a backend asks of a rank graph. compute_dtype: ONNX element type of activations (and of weights used
    as stored); pools_in_place: no state pool is a graph input or output, the plugins reach the pools through the
    pool table input [P, 3] int64 (`plugins/pool_table.py`) and update them in place, MoE receive buffers are
    static (bounded by the recipe's limits) and plugin scratch is a plugin output; otherwise the pools are graph
    inputs and the step's new states and cache rows graph outputs, which the runtime writes back."""

    compute_dtype: int = TensorProto.FLOAT
    pools_in_place: bool = False


class RankGraph:
    """Emits one rank's decoder (gpt-fast style: one method per block, in forward order)."""

    def __init__(self, cfg: ModelConfig, mapping: Mapping, weights_path: Path, topk_override: int | None = None,
                 use_indexer: bool = True, kv_cache: str = "fp32", form: GraphForm = GraphForm(), limits=None):
        self.cfg, self.m = cfg, mapping
        self.limits = limits  # pools in place: the recipe's limits size the MoE / indexer plugins' workspace outputs
        self.form = form
        self.kv_cache = kv_cache
        self.pools: list[tuple[str, int, list]] = []  # pools in place: (name, element type, dims) in table row order
        # MXFP4 bytes (and their E8M0 scales) as the MoE plugin receives them: uint8, or int8 views of the same bytes
        # where the pools are in place (TensorRT's ONNX parser would widen uint8 initializers to int32;
        # plugins/tensorrt_contracts.py: PARSER_UINT8_WEIGHTS_BECOME_INT32)
        self.mxfp4_type = TensorProto.INT8 if form.pools_in_place else TensorProto.UINT8
        self.cache_type = cache_storage_type(kv_cache)
        self.g = GraphBuilder(weights_path, form.compute_dtype)
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
        return logits if m.tp == 1 else g.plugin("AllGather", [logits], "lm_head.all_gather", group="tp", axis=-1,
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

    # ---- KDA ----
    def kda(self, i: int, x: str, io: dict) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        a = layer_prefix(cfg, i) + "self_attn."
        n = f"layers.{i}.kda"
        hl, dh, w = self.kda_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        p_l = hl * dh
        qkv = g.op("Concat", [g.linear(x, f"{a}{c}_proj.weight", f"{n}.{c}_proj") for c in "qkv"], f"{n}.qkv", axis=-1)
        conv_w = g.op("Concat", [g.reshape(g.weight(f"{a}{c}_conv1d.weight", dtype=TensorProto.FLOAT), [p_l, w],
                                           f"{n}.{c}_conv_w") for c in "qkv"], f"{n}.conv_w", axis=0)  # fmt: skip
        if self.form.pools_in_place:  # TensorRT: the plugins update the pools' slots in place, through the pool table
            conv_y = g.plugin("ShortConv", [qkv, conv_w, POOL_TABLE, io["cu"], io["slots"]], f"{n}.short_conv",
                              pool=io["conv"])
            conv_out = None
        else:
            # The step's sequences' windows / states only ([N, ...], addressed by local slots 0..N-1): the plugin
            # outputs are then the touched slots' new values, which the runtime writes back (O(tokens), not O(pool)).
            conv_in = g.op("Gather", [io["conv"], io["slots"]], f"{n}.conv_windows", axis=0)
            conv_y, conv_out = g.plugin("ShortConv", [qkv, conv_w, conv_in, io["cu"], io["local_slots"]],
                                        f"{n}.short_conv", 2)
        q, k, v = (g.reshape(g.slice_last(conv_y, j * p_l, (j + 1) * p_l, f"{n}.{c}_conv"), [-1, hl, dh], f"{n}.{c}")
                   for j, c in enumerate("qkv"))
        f_b = g.to_f32(g.linear(g.linear(x, f"{a}f_a_proj.weight", f"{n}.f_a"), f"{a}f_b_proj.weight", f"{n}.f_b"), f"{n}.f_b")
        u = g.op("Add", [f_b, g.weight(f"{a}dt_bias", dtype=TensorProto.FLOAT)], f"{n}.gate_in")  # fp32 gates
        u = g.reshape(u, [-1, hl, dh], f"{n}.gate_in_heads")
        h0 = m.tp_rank * hl
        a_log = g.slice_last(g.reshape(g.weight(f"{a}A_log", dtype=TensorProto.FLOAT), [-1], f"{n}.A_log_flat"), h0, h0 + hl,
                             f"{n}.A_log_local")  # fmt: skip
        decay = g.reshape(g.op("Exp", [a_log], f"{n}.A"), [1, hl, 1], f"{n}.A_heads")
        if cfg.gate_lower_bound is not None:  # safe gate: lower_bound * sigmoid(A * u), in (lb, 0)
            s = g.op("Sigmoid", [g.op("Mul", [decay, u], f"{n}.Au")], f"{n}.gate_sigmoid")
            log_decay = g.op("Mul", [s, g.const(cfg.gate_lower_bound, np.float32, "lower_bound")], f"{n}.g")
        else:  # -A * softplus(u)
            sp = g.op("Softplus", [u], f"{n}.softplus")
            log_decay = g.op("Neg", [g.op("Mul", [decay, sp], f"{n}.A_sp")], f"{n}.g")
        beta = g.op("Sigmoid", [g.to_f32(g.linear(x, f"{a}b_proj.weight", f"{n}.b_proj"), f"{n}.b_proj")], f"{n}.beta")
        scan = dict(scale=float(dh**-0.5), use_qk_l2norm=1)
        if self.form.pools_in_place:
            o = g.plugin("GatedDeltaScan", [q, k, v, log_decay, beta, POOL_TABLE, io["cu"], io["slots"]],
                         f"{n}.gated_delta_scan", pool=io["state"], **scan)
            state_out = None
        else:
            state_in = g.op("Gather", [io["state"], io["slots"]], f"{n}.states", axis=0)
            o, state_out = g.plugin("GatedDeltaScan", [q, k, v, log_decay, beta, state_in, io["cu"], io["local_slots"]],
                                    f"{n}.gated_delta_scan", 2, **scan)
        if cfg.use_full_rank_gate:
            gate = g.linear(x, f"{a}g_proj.weight", f"{n}.g_proj")
        else:
            gate = g.linear(g.linear(x, f"{a}g_a_proj.weight", f"{n}.g_a"), f"{a}g_b_proj.weight", f"{n}.g_b")
        gate = g.reshape(gate, [-1, hl, dh], f"{n}.gate_heads")
        normed = g.rms_norm(o, f"{a}o_norm.weight", cfg.rms_norm_eps, f"{n}.o_norm")
        y = g.reshape(g.sigmoid_mul(normed, gate, f"{n}.gated"), [-1, p_l], f"{n}.o_flat")
        if not self.form.pools_in_place:
            io["conv_out"], io["state_out"] = conv_out, state_out
        return g.all_reduce(g.linear(y, f"{a}o_proj.weight", f"{n}.o_proj"), "tp", m.tp, f"{n}.all_reduce")

    # ---- MLA (NoPE, absorbed over the latent cache) + DSA ----
    def mla(self, i: int, x: str, io: dict) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        a = layer_prefix(cfg, i) + "self_attn."
        n = f"layers.{i}.mla"
        hl, nope, rope, vd, r = self.mla_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_latent = None
        if cfg.q_lora_rank:
            q_latent = g.rms_norm(g.linear(x, f"{a}q_a_proj.weight", f"{n}.q_a"), f"{a}q_a_layernorm.weight",
                                  MLA_LATENT_NORM_EPS, f"{n}.q_a_norm")
            q = g.linear(q_latent, f"{a}q_b_proj.weight", f"{n}.q_b")
        else:
            q = g.linear(x, f"{a}q_proj.weight", f"{n}.q_proj")
        q = g.op("Transpose", [g.reshape(q, [-1, hl, nope + rope], f"{n}.q_heads")], f"{n}.q_hT", perm=[1, 0, 2])
        q_nope = g.slice_last(q, 0, nope, f"{n}.q_nope")  # [H, T, nope]
        q_pe = g.slice_last(q, nope, nope + rope, f"{n}.q_pe")
        kv_b = g.reshape(g.weight(f"{a}kv_b_proj.weight"), [hl, nope + vd, r], f"{n}.kv_b_heads")
        w_kc = g.op("Slice", [kv_b, g.const([0]), g.const([nope]), g.const([1])], f"{n}.w_kc")  # [H, nope, r]
        w_vc = g.op("Slice", [kv_b, g.const([nope]), g.const([nope + vd]), g.const([1])], f"{n}.w_vc")  # [H, v, r]
        q_lat = g.op("MatMul", [q_nope, w_kc], f"{n}.q_absorb")  # [H, T, r]
        q_full = g.op("Transpose", [g.op("Concat", [q_lat, q_pe], f"{n}.q_cat", axis=-1)], f"{n}.q_lat", perm=[1, 0, 2])
        ckv = g.linear(x, f"{a}kv_a_proj_with_mqa.weight", f"{n}.kv_a")
        c = g.rms_norm(g.slice_last(ckv, 0, r, f"{n}.c"), f"{a}kv_a_layernorm.weight", MLA_LATENT_NORM_EPS, f"{n}.c_norm")
        entry = g.op("Concat", [c, g.slice_last(ckv, r, r + rope, f"{n}.k_pe")], f"{n}.cache_entry", axis=-1)
        entry = self.round_to_storage(g.to_f32(entry, f"{n}.cache_entry"), f"{n}.cache_rows")
        if self.form.pools_in_place:  # written into the pool first; the attention takes the rows from the write
            entry = self.write_cache(io["mla"], entry, io, f"{n}.cache_write")
        else:
            io["mla_out"] = entry
        # Dense layers pass an empty [0, 0] index tensor (the op's "dense causal" form), so the node always
        # has the six inputs TensorRT's plugin signature fixes.
        if self.use_indexer and cfg.has_indexer(i):
            indices = self.last_indices = self.indexer(i, x, q_latent, io)
        elif self.use_indexer:  # "shared" layer: reuse the previous full layer's selection
            indices = self.last_indices
        else:
            indices = g.const(np.zeros((0, 0)), np.int64, "dense")
        pool = POOL_TABLE if self.form.pools_in_place else io["mla"]
        attn_inputs = [g.to_f32(q_full, f"{n}.q_lat"), pool, entry, io["cu"], io["tables"], io["positions"], indices]
        o_lat = g.plugin("SparseMLAAttention", attn_inputs, f"{n}.attention",
                         scale=float((nope + rope) ** -0.5), kv_lora_rank=r, **self.pool_attributes(io["mla"]))
        o_t = g.op("Transpose", [g.to_act(o_lat, f"{n}.attention")], f"{n}.o_latT", perm=[1, 0, 2])  # [H, T, r]
        o = g.op("MatMul", [o_t, g.op("Transpose", [w_vc], f"{n}.w_vcT", perm=[0, 2, 1])], f"{n}.v_up")  # [H, T, v]
        y = g.reshape(g.op("Transpose", [o], f"{n}.oT", perm=[1, 0, 2]), [-1, hl * vd], f"{n}.o_flat")
        if cfg.mla_use_output_gate:
            y = g.sigmoid_mul(y, g.linear(x, f"{a}g_proj.weight", f"{n}.g_proj"), f"{n}.gated")
        return g.all_reduce(g.linear(y, f"{a}o_proj.weight", f"{n}.o_proj"), "tp", m.tp, f"{n}.all_reduce")

    def indexer(self, i: int, x: str, q_latent: str, io: dict) -> str:
        """DSA lightning indexer: writes this step's keys, returns top-k indices [T, topk] (-1 padded)."""
        g, cfg = self.g, self.cfg
        a = layer_prefix(cfg, i) + "self_attn.indexer."
        n = f"layers.{i}.indexer"
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        q = g.reshape(g.to_f32(g.linear(q_latent, f"{a}wq_b.weight", f"{n}.wq_b"), f"{n}.wq_b"), [-1, hi, di], f"{n}.q")
        k = g.op("LayerNormalization", [g.to_f32(g.linear(x, f"{a}wk.weight", f"{n}.wk"), f"{n}.wk"),
                                        g.weight(f"{a}k_norm.weight", dtype=TensorProto.FLOAT),
                                        g.weight(f"{a}k_norm.bias", dtype=TensorProto.FLOAT)],
                 f"{n}.k_norm", axis=-1, epsilon=INDEXER_KNORM_EPS)  # fmt: skip
        k = self.round_to_storage(k, f"{n}.cache_rows")
        if self.form.pools_in_place:  # written into the pool first; the indexer takes the keys from the write
            k = self.write_cache(io["index"], k, io, f"{n}.cache_write")
        else:
            io["index_out"] = k
        # score[t, s] = sum_h (w[t, h] * Hi^-0.5 * Di^-0.5) * relu(q[t, h] . k[s]); the op applies relu and sums.
        weights = g.op("Mul", [g.to_f32(g.linear(x, f"{a}weights_proj.weight", f"{n}.weights_proj"), f"{n}.weights_proj"),
                               g.const((hi**-0.5) * (di**-0.5), np.float32, "index_scale")], f"{n}.head_weights")
        pool = POOL_TABLE if self.form.pools_in_place else io["index"]
        inputs = [q, weights, pool, k, io["cu"], io["tables"], io["positions"]]
        if not self.form.pools_in_place:
            return g.plugin("DSAIndexer", inputs, f"{n}.topk", topk=int(self.topk))
        # TensorRT: the chunk buffers are the plugin's second output, in the engine's device memory
        from moe_export.plugins.dsa_indexer.sizes import workspace_bytes

        limits = self.limits
        length = -(-limits.max_seq_len // limits.block_size) * limits.block_size  # the tables' capacity
        size = workspace_bytes(limits.max_num_tokens, length, int(self.topk))
        return g.plugin("DSAIndexer", inputs, f"{n}.topk", 2, topk=int(self.topk), scratch_bytes=size,
                        **self.pool_attributes(io["index"]))[0]

    def pool(self, name: str, elem: int, dims: list):
        """A pool of the layer: on ONNX Runtime a graph input (its name); on TensorRT a row of the pool table (its
        row index), listed in the graph's metadata for the runner, which owns the pools."""
        if not self.form.pools_in_place:
            return self._input(name, elem, dims)
        self.pools.append((name, elem, dims))
        return len(self.pools) - 1

    def pool_attributes(self, pool) -> dict:
        """A paged-cache op's attributes for its pool on TensorRT (row, block size, storage); none on ONNX Runtime."""
        if not self.form.pools_in_place:
            return {}
        return dict(pool=pool, block_size=int(self.limits.block_size), pool_dtype=self.kv_cache)

    def write_cache(self, pool: int, rows: str, io: dict, name: str) -> str:
        """TensorRT: PagedCacheWrite of the step's rounded rows into table row `pool`'s pool; returns the rows as
        the node passes them on (the pool's readers take them from there, so they run after the write)."""
        return self.g.plugin("PagedCacheWrite", [POOL_TABLE, rows, io["cu"], io["tables"], io["positions"]], name,
                             **self.pool_attributes(pool))

    def round_to_storage(self, rows: str, name: str) -> str:
        """fp32 cache rows [T, D] rounded to the pool's storage dtype (kept fp32: the runtime stores them exactly)."""
        if self.cache_type == TensorProto.FLOAT:
            return rows
        if self.cache_type == TensorProto.UINT8:
            return round_to_fp8_rows(self.g, rows, name)
        stored = self.g.op("Cast", [rows], f"{name}.stored", to=self.cache_type)
        return self.g.op("Cast", [stored], name, to=TensorProto.FLOAT)

    # ---- FFNs ----
    def mlp(self, x: str, prefix: str, name: str, group_size: int) -> str:
        g = self.g
        gate = g.linear(x, f"{prefix}gate_proj.weight", f"{name}.gate_proj")
        up = g.linear(x, f"{prefix}up_proj.weight", f"{name}.up_proj")
        y = g.linear(g.gated_act(gate, up, self.cfg, f"{name}.act"), f"{prefix}down_proj.weight", f"{name}.down_proj")
        return g.all_reduce(y, "tp", group_size, f"{name}.all_reduce")

    def group_limit(self, choice: str, n: str) -> str:
        """Group-limited routing (DeepSeek-V3): choice scores [T, E] -> the same with every expert outside the
        topk_group groups of best top-2 sum set to -inf (E experts in num_expert_group equal groups)."""
        g, cfg = self.g, self.cfg
        groups, per = cfg.num_expert_group, cfg.num_experts // cfg.num_expert_group
        grouped = g.op("Reshape", [choice, g.const([0, groups, per])], f"{n}.grouped")  # [T, G, E/G]
        top2, _ = g.op("TopK", [grouped, g.const([2])], f"{n}.group_top2", 2, axis=-1)
        group_score = g.op("ReduceSum", [top2, g.const([-1])], f"{n}.group_score", keepdims=0)  # [T, G]
        _, kept = g.op("TopK", [group_score, g.const([cfg.topk_group])], f"{n}.group_topk", 2, axis=-1)
        def filled(like: str, value: float, name: str) -> str:
            return g.op("ConstantOfShape", [g.op("Shape", [like], f"{name}.shape")], name,
                        value=helper.make_tensor("value", TensorProto.FLOAT, [1], [value]))

        mask = g.op("ScatterElements", [filled(group_score, 0.0, f"{n}.zeros"), kept, filled(kept, 1.0, f"{n}.ones")],
                    f"{n}.group_mask", axis=-1)  # [T, G]: 1 for the kept groups
        keep = g.op("Cast", [g.op("Unsqueeze", [mask, g.const([-1])], f"{n}.group_mask3")], f"{n}.keep",
                    to=TensorProto.BOOL)
        masked = g.op("Where", [keep, grouped, g.const(float("-inf"), np.float32, "neg_inf")], f"{n}.masked")
        return g.op("Reshape", [masked, g.const([0, cfg.num_experts])], f"{n}.choice_grouped")

    def token_share(self, x: str, name: str) -> tuple[str, str, str]:
        """This rank's rows of x [T, D] in the dp layout: rows r*c .. min((r+1)*c, T) of its tp group's tokens,
        r = tp_rank, c = ceil(T / tp) (the tp ranks' shares in rank order are the T rows once). Returns the share
        and, for `gather_shares`, T [1] and the rows it lacks to c [1] (only the last ranks lack rows)."""
        g, m = self.g, self.m
        rows = g.op("Shape", [x], f"{name}.shape", end=1)  # [1]
        share = g.op("Div", [g.op("Add", [rows, g.const([m.tp - 1])], f"{name}.rows_up"), g.const([m.tp])], f"{name}.share")
        start = g.op("Min", [g.op("Mul", [share, g.const([m.tp_rank])], f"{name}.start_raw"), rows], f"{name}.start")
        end = g.op("Min", [g.op("Add", [start, share], f"{name}.end_raw"), rows], f"{name}.end")
        short = g.op("Sub", [share, g.op("Sub", [end, start], f"{name}.taken")], f"{name}.short")
        return g.op("Slice", [x, start, end, g.const([0])], name), rows, short

    def gather_shares(self, y: str, rows: str, short: str, name: str) -> str:
        """The tp group's shares y [rows taken, D] back as [T, D]: each padded with zero rows to c (at most tp - 1
        rows in all, so every rank gathers an equal block, the static shape TensorRT's AllGather needs), gathered
        in rank order (the padding lands after the T real rows) and cut to T."""
        g, m = self.g, self.m
        pads = g.op("Concat", [g.const([0, 0]), short, g.const([0])], f"{name}.pads", axis=0)
        padded = g.op("Pad", [y, pads], f"{name}.padded")
        gathered = g.plugin("AllGather", [padded], name, group="tp", axis=0, group_size=m.tp)
        return g.op("Slice", [gathered, g.const([0]), rows, g.const([0])], f"{name}.rows")

    def moe(self, i: int, x: str) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        p = layer_prefix(cfg, i) + "block_sparse_moe."
        n = f"layers.{i}.moe"
        tokens = x
        if m.all_to_all and m.tp > 1:  # each tp rank routes and dispatches its share of the group's tokens
            x, rows, short = self.token_share(x, f"{n}.token_share")
        router = g.to_f32(g.linear(x, f"{p}gate.weight", f"{n}.router"), f"{n}.router")  # fp32-accumulated logits
        scores = g.op("Sigmoid", [router], f"{n}.scores")  # fp32 [T, E]
        choice = g.op("Add", [scores, g.weight(f"{p}gate.e_score_correction_bias", dtype=TensorProto.FLOAT)], f"{n}.choice")
        if cfg.num_expert_group > 1:
            choice = self.group_limit(choice, n)
        _, ids = g.op("TopK", [choice, g.const([cfg.num_experts_per_token])], f"{n}.topk", 2, axis=-1)
        w = g.op("GatherElements", [scores, ids], f"{n}.weights", axis=-1)
        if cfg.moe_renormalize:
            total = g.op("ReduceSum", [w, g.const([-1])], f"{n}.wsum", keepdims=1)
            w = g.op("Div", [w, g.op("Add", [total, g.const(1e-20, np.float32, "tiny")], f"{n}.wsum_eps")], f"{n}.wnorm")
        if cfg.routed_scaling_factor != 1.0:
            w = g.op("Mul", [w, g.const(cfg.routed_scaling_factor, np.float32, "routed_scale")], f"{n}.wscaled")
        z = g.linear(x, f"{p}routed_expert_down_proj.weight", f"{n}.latent_down") if cfg.routed_expert_hidden_size else x
        e = f"{p}experts."
        if m.all_to_all:  # the tokens go to their experts' ranks; the expert op sees the rows it received
            dispatched = z
            bound = {}
            if self.form.pools_in_place:  # TensorRT: static shapes, receive buffers bounded by the recipe's limits
                bound = dict(group_size=m.ep, max_recv_rows=m.max_recv_rows(self.limits.max_num_tokens))
            z, ids, w, *layout = g.plugin("MoEDispatch", [z, ids, w], f"{n}.dispatch", 6, group="ep",
                                          num_experts=cfg.num_experts, **bound)
        workspace = {}
        if self.form.pools_in_place:  # TensorRT: the plugin's scratch is its second output, in the engine's memory
            from moe_export.plugins.moe_mxfp4.sizes import workspace_bytes

            local = len(m.local_experts(cfg.num_experts))
            expert_rows = m.max_recv_rows(self.limits.max_num_tokens) if m.all_to_all else self.limits.max_num_tokens
            workspace = dict(n_out=2, scratch_bytes=workspace_bytes(expert_rows, cfg.num_experts_per_token, cfg.expert_in_dim,
                                                                    cfg.moe_intermediate_size, local))
        partial = g.plugin(
            "MoEMXFP4",
            [g.to_f32(z, f"{n}.experts_in"), ids, w] + [g.weight(e + t, as_float=False, byte_view=self.mxfp4_type)
                                                        for t in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")],
            f"{n}.experts",
            expert_offset=m.local_experts(cfg.num_experts).start,
            activation=cfg.hidden_act,
            situ_beta=float(cfg.situ_beta or 0.0),
            situ_linear_beta=float(cfg.situ_linear_beta or 0.0),
            **workspace,
        )
        if workspace:
            partial = partial[0]  # output 1, the workspace, is only written and read by the plugin itself
        if m.all_to_all:  # back to the tokens' ranks, summed per token (latent space)
            y = g.plugin("MoECombine", [g.to_act(partial, f"{n}.experts"), *layout, dispatched], f"{n}.combine",
                         group="ep")
            if m.tp > 1:
                y = self.gather_shares(y, rows, short, f"{n}.token_all_gather")
        else:
            y = g.all_reduce(g.to_act(partial, f"{n}.experts"), "ep", m.ep, f"{n}.experts_all_reduce")  # latent space
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                y = g.rms_norm(y, f"{p}routed_expert_norm.weight", cfg.rms_norm_eps, f"{n}.latent_norm")
            y = g.linear(y, f"{p}routed_expert_up_proj.weight", f"{n}.latent_up")
        if cfg.num_shared_experts:
            y = g.op("Add", [y, self.mlp(tokens, f"{p}shared_experts.", f"{n}.shared", m.tp)], f"{n}.out")
        return y

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
        if self.form.pools_in_place and self.pools:
            self._input(POOL_TABLE, TensorProto.INT64, [len(self.pools), 3])
        self._state_outputs(state_outputs)
        return self._model()

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

    def _model(self) -> onnx.ModelProto:
        """The graph built so far as a model, with metadata: the rank's mapping, its weights file and (pools in
        place) the pool table's rows."""
        g = self.g
        graph = helper.make_graph(g.nodes, f"rank{self.m.rank}", self.inputs, self.outputs, g.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
            producer_name="moe-export",
        )
        model.ir_version = 10
        meta = [("mapping", json.dumps(self.m.to_dict(), sort_keys=True)), ("weights", g.weights_file)]
        if self.form.pools_in_place:
            meta.append((POOLS_KEY, json.dumps([{"name": n, "elem_type": e, "dims": d} for n, e, d in self.pools])))
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


def cache_storage_type(kv_cache: str) -> int:
    """ONNX element type of the cache pools for the recipe's `quantization.kv_cache`."""
    if kv_cache not in CACHE_STORAGE:
        raise InputError(f"quantization.kv_cache {kv_cache!r}: the graphs store caches as one of "
                         f"{sorted(CACHE_STORAGE)}")
    return CACHE_STORAGE[kv_cache]


def graph_summary(model: onnx.ModelProto) -> dict:
    """Op counts by type (plugin ops prefixed with their domain), inputs and outputs."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return {
        "nodes": len(model.graph.node),
        "op_counts": dict(sorted(counts.items())),
        "plugin_nodes": {k: v for k, v in sorted(counts.items()) if k.startswith(DOMAIN + "::")},
        "inputs": [v.name for v in model.graph.input],
        "outputs": [v.name for v in model.graph.output],
        "initializers": len(model.graph.initializer),
    }

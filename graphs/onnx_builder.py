"""`GraphBuilder`: an ONNX graph (opset 21) under construction, its nodes, external-data initializers (byte
ranges of a safetensors file) and small constants, with the building blocks every exported graph uses (GEMM,
RMS norm, gated activations, collectives); `graph_summary` counts a finished model's ops.

Weights are initializers stored as external data inside the rank's safetensors file (the safetensors data
section is raw little-endian bytes, so each initializer points at its byte range).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import onnx
from moe_export.common.model_config import ModelConfig
from moe_export.plugins import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION
from onnx import TensorProto, helper

ONNX_OPSET = 21
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

    def __init__(self, weights_path: Path, compute_dtype: int = TensorProto.FLOAT, ordered_collectives: bool = False):
        self.act = compute_dtype  # element type of activations and of weights used as stored
        self.ordered_collectives = ordered_collectives  # `collective`: each collective after the previous one
        self._last_collective: str | None = None
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

    def collective(self, op_type: str, inputs: list[str], name: str, n_out: int = 1, **attrs):
        """A collective node (`plugin`). With ordered collectives (`GraphForm.ordered_collectives`: TensorRT
        graphs) it takes one more input, `after`: the previous collective's first output (the first collective's:
        its own first input), of the activations' type; the plugin never reads it. Every two collectives of the
        graph are then ordered by a data path (contract TRT_ORDERS_BY_DATA_DEPENDENCIES)."""
        if self.ordered_collectives:
            inputs = [*inputs, self._last_collective or inputs[0]]
        out = self.plugin(op_type, inputs, name, n_out, **attrs)
        if self.ordered_collectives:
            self._last_collective = out if n_out == 1 else out[0]
        return out

    def all_reduce(self, x: str, group: str, size: int, name: str) -> str:
        return x if size == 1 else self.collective("AllReduce", [x], name, group=group, reduce_op="sum")


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

"""ONNX Runtime lowering of ShortConv: a model-local FunctionProto (domain DOMAIN, same op type) whose body
uses standard ONNX ops only (opset 21), no loops; ORT inlines it. The TensorRT graph keeps the bare node.

Body (the gather formulation of ``cpu``; exact fp32):
  ext   = Concat(Reshape(Transpose(Gather(conv_pool, slot_ids)), [N(W-1), C]), x)      [N(W-1)+T, C]
  n_t   = #{n : cu_seqlens[n+1] <= t} (sequence of token t); p = t - cu_seqlens[n_t] - (W-1) + j
  rows  = Where(p >= 0, N(W-1) + t - (W-1) + j, n_t (W-1) + (W-1) + p)                 [T, W]
  a     = ReduceSum(Gather(ext, rows) * weight^T, axis 1);  y = a * Sigmoid(a)
  final = Gather(ext, same rule for p = L_n - (W-1) + i, i < W-1)                     [N, W-1, C]
  conv_pool_out = ScatterND(conv_pool, slot_ids[:, None], Transpose(final))
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .. import DOMAIN, PLUGIN_VERSION
from .onnx_schema import INPUTS, OP_TYPE, OUTPUTS

ONNX_OPSET = 21
_INT64_MAX = 2**63 - 1


class _Nodes:
    """Node list with fresh value names; ``op`` returns the output name."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        name = out or f"{self.prefix}{len(self.nodes)}_{op_type}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(self, value) -> str:
        """int64 Constant: 1-D for a list, 0-D for a scalar."""
        dims = [len(value)] if isinstance(value, list) else []
        vals = value if isinstance(value, list) else [value]
        return self.op("Constant", value=helper.make_tensor("c", TensorProto.INT64, dims, vals))

    def dim(self, x: str, axis: int) -> str:
        """0-D int64 size of ``x`` along ``axis``."""
        return self.op("Squeeze", self.op("Shape", x, start=axis, end=axis + 1), self.const([0]))

    def col(self, x: str) -> str:
        return self.op("Unsqueeze", x, self.const([1]))

    def row(self, x: str) -> str:
        return self.op("Unsqueeze", x, self.const([0]))


def _rows(b: _Nodes, pos: str, rel: str, seq: str, n_rows_state: str, wm1: str, span: str) -> str:
    """ext rows [R, J] for entries at relative positions rel[:, None] - (W-1) + span[None, :] (rel = position
    in the sequence, pos = packed token index of rel = 0 offset, seq = sequence index; all [R])."""
    p = b.op("Add", b.op("Sub", b.col(rel), wm1), b.row(span))
    from_x = b.op("Add", n_rows_state, b.op("Add", b.col(b.op("Sub", pos, wm1)), b.row(span)))
    from_state = b.op("Add", b.op("Add", b.col(b.op("Mul", seq, wm1)), wm1), p)
    return b.op("Where", b.op("GreaterOrEqual", p, b.const(0)), from_x, from_state)


def function_proto() -> onnx.FunctionProto:
    """FunctionProto implementing ShortConv in opset-21 ONNX (inputs/outputs/attributes as the schema)."""
    b = _Nodes("sc_")
    f32 = TensorProto.FLOAT
    zero, one = b.const(0), b.const(1)
    num_tokens, channels = b.dim("x", 0), b.dim("x", 1)
    width = b.dim("weight", 1)
    wm1 = b.op("Sub", width, one)
    num_seqs = b.dim("slot_ids", 0)
    n_rows_state = b.op("Mul", num_seqs, wm1)
    windows = b.op("Transpose", b.op("Cast", b.op("Gather", "conv_pool", "slot_ids", axis=0), to=f32), perm=[0, 2, 1])
    flat_shape = b.op("Concat", b.row(n_rows_state), b.row(channels), axis=0)
    ext = b.op("Concat", b.op("Reshape", windows, flat_shape), b.op("Cast", "x", to=f32), axis=0)
    starts = b.op("Slice", "cu_seqlens", b.const([0]), b.const([-1]))  # [N]
    ends = b.op("Slice", "cu_seqlens", b.const([1]), b.const([_INT64_MAX]))  # [N]
    tokens = b.op("Range", zero, num_tokens, one)  # [T]
    seq = b.op(
        "ReduceSum",
        b.op("Cast", b.op("GreaterOrEqual", b.col(tokens), b.row(ends)), to=TensorProto.INT64),
        b.const([1]),
        keepdims=0,
    )  # [T]
    taps = b.op("Range", zero, width, one)  # [W]
    rel = b.op("Sub", tokens, b.op("Gather", starts, seq))
    rows = _rows(b, tokens, rel, seq, n_rows_state, wm1, taps)  # [T, W]
    acts = b.op("ReduceSum", b.op("Mul", b.op("Gather", ext, rows, axis=0), b.op("Transpose", "weight")),
                b.const([1]), keepdims=0)  # fmt: skip
    b.op("CastLike", b.op("Mul", acts, b.op("Sigmoid", acts)), "x", out="y")
    lengths = b.op("Sub", ends, starts)
    seqs = b.op("Range", zero, num_seqs, one)  # [N]
    window = b.op("Range", zero, wm1, one)  # [W-1]
    final_rows = _rows(b, b.op("Add", starts, lengths), lengths, seqs, n_rows_state, wm1, window)  # [N, W-1]
    final = b.op("Transpose", b.op("Gather", ext, final_rows, axis=0), perm=[0, 2, 1])  # [N, C, W-1]
    b.op("ScatterND", "conv_pool", b.col("slot_ids"), b.op("CastLike", final, "conv_pool"), out="conv_pool_out")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attribute_protos=[helper.make_attribute("plugin_version", PLUGIN_VERSION)],
    )

"""ONNX Runtime lowering of MoEMXFP4: a model-local FunctionProto (domain DOMAIN, same op type) in standard
ONNX (opset 21) that ORT inlines; the TensorRT graph keeps the bare node.

Body:
  dequantize: nibbles by BitwiseAnd 15 / BitShift right 4 on uint8, Gather from the 16-entry E2M1 table,
  interleave (low = even), times Pow(2, s - 127) per 32 elements (s = 255 -> NaN); the weights are
  initializers, so ONNX Runtime folds this at session load;
  M[t, e] = Σ_j expert_weights[t, j] * (expert_ids[t, j] - expert_offset == e) [T, E]; the used experts
  u = NonZero(any token chose e) [U];
  per expert set W: h = x @ W13^T [U, T, 2I]; the activation is computed both ways and chosen with
  Where(Equal(activation, "silu")); out = act @ W2^T [U, T, D]; y = M[:, u] @ out per token.
  The expert set is chosen by an If: when 3U < E (a decode step of one token uses k of E) the used experts
  are gathered (a copy of U experts' weights, then the matmuls read them again: ~3U expert reads), otherwise
  all E are multiplied in place (E reads) and the unchosen experts' outputs are zeroed with a Where.
An unchosen expert never reaches y (a NaN scale byte there does not poison the output, as in the other kernels).
Memory U*(3*I*D) + U*T*(2I + D) floats in the first case, E*T*(2I + D) in the second.
"""

import onnx
from onnx import TensorProto, helper

from moe_export.quantize import mxfp4

from .. import DOMAIN
from ..sparse_mla_attention.ort import ONNX_OPSET, FunctionBuilder
from .onnx_schema import OP_TYPE


def _dequantize(b: FunctionBuilder, packed: str, scale: str) -> str:
    """[E, R, C/2] u8 + [E, R, C/32] u8 -> [E, R, C] float."""
    table = b.op("Constant", value=helper.make_tensor("e2m1", TensorProto.FLOAT, [16], list(mxfp4.E2M1_VALUES)))
    mask = b.op("Constant", value=helper.make_tensor("m", TensorProto.UINT8, [], [15]))
    shift = b.op("Constant", value=helper.make_tensor("s", TensorProto.UINT8, [], [4]))
    low = b.op("BitwiseAnd", packed, mask)
    high = b.op("BitShift", packed, shift, direction="RIGHT")
    pair = [
        b.op("Unsqueeze", b.op("Gather", table, b.op("Cast", nibble, to=TensorProto.INT64)), b.ints([-1]))
        for nibble in (low, high)
    ]
    values = b.op("Reshape", b.op("Concat", *pair, axis=-1), b.ints([0, 0, -1, 32]))  # [E, R, C/32, 32]
    s = b.op("Cast", scale, to=TensorProto.FLOAT)
    factor = b.op("Pow", b.float_scalar(2.0), b.op("Sub", s, b.float_scalar(127.0)))
    factor = b.op("Where", b.op("Equal", s, b.float_scalar(255.0)), b.float_scalar(float("nan")), factor)
    return b.op("Reshape", b.op("Mul", values, b.op("Unsqueeze", factor, b.ints([-1]))), b.ints([0, 0, -1]))


def _expert_ffn(b: FunctionBuilder, w13: str, w2: str, mix: str, act_kind: dict, keep: str | None = None) -> str:
    """y [T, D] = Σ_e mix[t, e] * FFN_e(x[t]) over the experts stacked in w13 [U, 2I, D] and w2 [U, D, I]; `mix`
    [T, U]; `keep` [U, 1, 1] bool zeroes the outputs of experts nobody chose (so their NaNs never reach y)."""
    h = b.op("MatMul", "x", b.op("Transpose", w13, perm=[0, 2, 1]))  # [U, T, 2I]
    gate = b.op("Slice", h, b.ints([0]), act_kind["inter"], b.ints([2]))
    up = b.op("Slice", h, act_kind["inter"], b.ints([2**62]), b.ints([2]))
    sig = b.op("Sigmoid", gate)
    silu = b.op("Mul", b.op("Mul", gate, sig), up)
    beta, lin_beta = act_kind["beta"], act_kind["linear_beta"]
    a = b.op("Mul", b.op("Mul", beta, b.op("Tanh", b.op("Div", gate, beta))), sig)
    situ = b.op("Mul", a, b.op("Mul", lin_beta, b.op("Tanh", b.op("Div", up, lin_beta))))
    act = b.op("Where", act_kind["is_silu"], silu, situ)  # [U, T, I]
    out = b.op("MatMul", act, b.op("Transpose", w2, perm=[0, 2, 1]))  # [U, T, D]
    if keep is not None:
        out = b.op("Where", keep, out, b.float_scalar(0.0))
    y = b.op("MatMul", b.op("Unsqueeze", mix, b.ints([1])), b.op("Transpose", out, perm=[1, 0, 2]))  # [T, 1, D]
    return b.op("Squeeze", y, b.ints([1]))


def _branch(b: FunctionBuilder, y: str, name: str) -> onnx.GraphProto:
    return helper.make_graph(b.nodes, name, [], [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)])


def function_proto() -> onnx.FunctionProto:
    """FunctionProto implementing MoEMXFP4."""
    b = FunctionBuilder("moe")
    local = b.op("Sub", "expert_ids", b.attr("expert_offset", "int"))  # [T, k]
    num_local = b.dim("w13_packed", 0)
    experts = b.op("Range", b.int_scalar(0), num_local, b.int_scalar(1))  # [E]
    hit = b.op("Equal", b.op("Unsqueeze", local, b.ints([-1])), experts)  # [T, k, E]
    weighted = b.op("Mul", b.op("Cast", hit, to=TensorProto.FLOAT), b.op("Unsqueeze", "expert_weights", b.ints([-1])))
    mix = b.op("ReduceSum", weighted, b.ints([1]), keepdims=0)  # [T, E]
    chosen = b.op("ReduceMax", b.op("Cast", hit, to=TensorProto.INT32), b.ints([0, 1]), keepdims=0)  # [E]
    used = b.op("Squeeze", b.op("NonZero", chosen), b.ints([0]))  # [U] local experts some token chose
    w13_all = _dequantize(b, "w13_packed", "w13_scale")  # [E, 2I, D]
    w2_all = _dequantize(b, "w2_packed", "w2_scale")  # [E, D, I]
    silu_str = b.op("Constant", value=helper.make_tensor("silu", TensorProto.STRING, [], [b"silu"]))
    act_kind = {
        "inter": b.op("Unsqueeze", b.op("Div", b.dim("w13_packed", 1), b.int_scalar(2)), b.ints([0])),
        "beta": b.attr("situ_beta", "float"),
        "linear_beta": b.attr("situ_linear_beta", "float"),
        "is_silu": b.op("Equal", b.attr("activation", "string"), silu_str),
    }
    g = FunctionBuilder("moe_used")  # few experts chosen (a decode step): multiply only those
    y_used = _expert_ffn(g, g.op("Gather", w13_all, used, axis=0), g.op("Gather", w2_all, used, axis=0),
                         g.op("Gather", mix, used, axis=1), act_kind)  # fmt: skip
    d = FunctionBuilder("moe_all")  # most experts chosen (prefill): all of them, no copy of the weights
    keep = d.op("Unsqueeze", d.op("Cast", chosen, to=TensorProto.BOOL), d.ints([1, 2]))
    y_all = _expert_ffn(d, w13_all, w2_all, mix, act_kind, keep)
    few = b.op("Less", b.op("Mul", b.dim(used, 0), b.int_scalar(3)), num_local)  # gathering U costs ~3U expert reads
    b.op("If", few, out="y", then_branch=_branch(g, y_used, "moe_used_experts"),
         else_branch=_branch(d, y_all, "moe_all_experts"))
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["x", "expert_ids", "expert_weights", "w13_packed", "w13_scale", "w2_packed", "w2_scale"],
        ["y"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["expert_offset", "activation", "situ_beta", "situ_linear_beta"],
    )

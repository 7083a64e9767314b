"""ONNX Runtime lowering of MoEMXFP4: a model-local FunctionProto (domain DOMAIN, same op type) in standard
ONNX (opset 21) that ORT inlines; the TensorRT graph keeps the bare node.

Body (over the U local experts some token of the step chose; memory U*(3*I*D + T*(2I + D)) floats):
  dequantize: nibbles by BitwiseAnd 15 / BitShift right 4 on uint8, Gather from the 16-entry E2M1 table,
  interleave (low = even), times Pow(2, s - 127) per 32 elements (s = 255 -> NaN); the weights are
  initializers, so ONNX Runtime folds this at session load;
  M[t, e] = Σ_j expert_weights[t, j] * (expert_ids[t, j] - expert_offset == e) [T, E]; the used experts
  u = NonZero(any token chose e) [U] (a decode step of one token uses k of E);
  h = x @ W13[u]^T [U, T, 2I]; the activation is computed both ways and chosen with
  Where(Equal(activation, "silu")); out = act @ W2[u]^T [U, T, D]; y = M[:, u] @ out per token.
An expert no token chose is never multiplied (a NaN scale byte there stays unread, as in the other kernels).
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


def function_proto() -> onnx.FunctionProto:
    """FunctionProto implementing MoEMXFP4."""
    b = FunctionBuilder("moe")
    local = b.op("Sub", "expert_ids", b.attr("expert_offset", "int"))  # [T, k]
    experts = b.op("Range", b.int_scalar(0), b.dim("w13_packed", 0), b.int_scalar(1))  # [E]
    hit = b.op("Equal", b.op("Unsqueeze", local, b.ints([-1])), experts)  # [T, k, E]
    weighted = b.op("Mul", b.op("Cast", hit, to=TensorProto.FLOAT), b.op("Unsqueeze", "expert_weights", b.ints([-1])))
    mix = b.op("ReduceSum", weighted, b.ints([1]), keepdims=0)  # [T, E]
    chosen = b.op("ReduceMax", b.op("Cast", hit, to=TensorProto.INT32), b.ints([0, 1]), keepdims=0)  # [E]
    used = b.op("Squeeze", b.op("NonZero", chosen), b.ints([0]))  # [U] local experts some token chose
    w13 = b.op("Gather", _dequantize(b, "w13_packed", "w13_scale"), used, axis=0)  # [U, 2I, D]
    w2 = b.op("Gather", _dequantize(b, "w2_packed", "w2_scale"), used, axis=0)  # [U, D, I]
    h = b.op("MatMul", "x", b.op("Transpose", w13, perm=[0, 2, 1]))  # [U, T, 2I]
    inter = b.op("Unsqueeze", b.op("Div", b.dim("w13_packed", 1), b.int_scalar(2)), b.ints([0]))
    gate = b.op("Slice", h, b.ints([0]), inter, b.ints([2]))
    up = b.op("Slice", h, inter, b.ints([2**62]), b.ints([2]))
    sig = b.op("Sigmoid", gate)
    silu = b.op("Mul", b.op("Mul", gate, sig), up)
    beta, lin_beta = b.attr("situ_beta", "float"), b.attr("situ_linear_beta", "float")
    a = b.op("Mul", b.op("Mul", beta, b.op("Tanh", b.op("Div", gate, beta))), sig)
    situ = b.op("Mul", a, b.op("Mul", lin_beta, b.op("Tanh", b.op("Div", up, lin_beta))))
    silu_str = b.op("Constant", value=helper.make_tensor("silu", TensorProto.STRING, [], [b"silu"]))
    act = b.op("Where", b.op("Equal", b.attr("activation", "string"), silu_str), silu, situ)  # [U, T, I]
    out = b.op("MatMul", act, b.op("Transpose", w2, perm=[0, 2, 1]))  # [U, T, D]
    mix_used = b.op("Unsqueeze", b.op("Gather", mix, used, axis=1), b.ints([1]))  # [T, 1, U]
    y = b.op("MatMul", mix_used, b.op("Transpose", out, perm=[1, 0, 2]))  # [T, 1, D]
    b.op("Squeeze", y, b.ints([1]), out="y")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["x", "expert_ids", "expert_weights", "w13_packed", "w13_scale", "w2_packed", "w2_scale"],
        ["y"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["expert_offset", "activation", "situ_beta", "situ_linear_beta"],
    )

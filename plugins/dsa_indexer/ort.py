"""ONNX Runtime lowering of DSAIndexer: a model-local FunctionProto (domain DOMAIN, same op type) in standard
ONNX (opset 21) that ORT inlines; the TensorRT graph keeps the bare node.

Body: token -> sequence, gather each token's keys at positions 0..B*BS-1 (B*BS = what the step's block tables
cover; the step's own keys from `k_new`, earlier ones from the pool, fp32 after the gather or the fp8 decode) [T, L, Di], scores = weights @ relu(q_idx @ keys^T)
([T, 1, Hi] x [T, Hi, L]), positions beyond the token -> -inf, TopK(k = min(topk, L), largest, sorted; ONNX
breaks ties towards the lower index, as the op does), -inf picks -> -1, Pad with -1 to `topk` columns.
Memory T*L*(Di + Hi) with L the used context, never the pool: fine for small models.
"""

import onnx
from onnx import helper

from .. import DOMAIN
from ..sparse_mla_attention.ort import ONNX_OPSET, FunctionBuilder
from .onnx_schema import OP_TYPE


def function_proto(fp8_pool: bool = False) -> onnx.FunctionProto:
    """FunctionProto implementing DSAIndexer (`fp8_pool`: for a uint8 fp8 key pool [NB, BS, Di + 1])."""
    b = FunctionBuilder("dsa")
    num_tokens = b.dim("q_idx", 0)
    max_len = b.op("Mul", b.dim("block_tables", 1), b.dim("k_pool", 1))
    seq = b.token_sequences(num_tokens, "cu_seqlens")
    span = b.op("Unsqueeze", b.op("Range", b.int_scalar(0), max_len, b.int_scalar(1)), b.ints([0]))  # [1, L]
    shape = b.op("Concat", b.op("Shape", "positions"), b.op("Unsqueeze", max_len, b.ints([0])), axis=0)
    span_t = b.op("Expand", span, shape)  # [T, L]
    keys = b.context_rows("k_pool", "k_new", "cu_seqlens", "block_tables", "positions", seq, span_t, fp8_pool)  # [T, L, Di]
    causal = b.op("LessOrEqual", span, b.op("Unsqueeze", "positions", b.ints([1])))
    keys = b.op("Where", b.op("Unsqueeze", causal, b.ints([2])), keys, b.float_scalar(0.0))
    per_head = b.op("Relu", b.op("MatMul", "q_idx", b.op("Transpose", keys, perm=[0, 2, 1])))  # [T, Hi, L]
    weights = b.op("Unsqueeze", "weights", b.ints([1]))  # [T, 1, Hi]
    scores = b.op("Squeeze", b.op("MatMul", weights, per_head), b.ints([1]))  # [T, L]
    scores = b.op("Where", causal, scores, b.float_scalar(float("-inf")))
    topk = b.attr("topk", "int")
    keep = b.op("Min", topk, max_len)
    values, order = b.op("TopK", scores, b.op("Unsqueeze", keep, b.ints([0])), outputs=2, axis=-1, largest=1, sorted=1)
    is_pad = b.op("IsInf", values, detect_positive=0)
    order = b.op("Where", is_pad, b.int_scalar(-1), order)
    pad_cols = b.op("Unsqueeze", b.op("Sub", topk, keep), b.ints([0]))
    pads = b.op("Concat", b.ints([0, 0, 0]), pad_cols, axis=0)
    b.op("Pad", order, pads, b.int_scalar(-1), out="indices")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["q_idx", "weights", "k_pool", "k_new", "cu_seqlens", "block_tables", "positions"],
        ["indices"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["topk"],
    )

"""ONNX Runtime lowering of DSAIndexer: a model-local FunctionProto (domain DOMAIN, same op type) in standard
ONNX (opset 21) that ORT inlines; the TensorRT graph keeps the bare node.

Body: a Loop over key tiles of the step's context (`sparse_mla_attention.ort.key_tiles`: about TILE_ELEMS floats
per tile whatever the context; a tile's rows read once per sequence, the step's own keys from `k_new`, earlier ones
from the pool, fp32 after the gather or the fp8 decode), each tile scored as weights @ relu(q_idx @ keys^T)
([T, 1, Hi] x [T, Hi, X]), positions of other sequences or beyond the token -> -inf, and merged into a running
top-k: TopK(topk) over [running values | tile scores] (largest, sorted; ONNX breaks ties towards the lower index,
and the running columns hold lower positions than the tile's, in order: ties go to the lower position, as the op
says). No full sort; memory O(T x tile), never the context or the pool. -inf picks -> -1.
"""

import onnx
from onnx import TensorProto, helper

from .. import DOMAIN
from ..sparse_mla_attention.ort import (
    ONNX_OPSET,
    SHARED_MACS_PER_GATHER,
    TILE_ELEMS,
    FunctionBuilder,
    key_loop,
    key_tiles,
    sequence_rows,
    tile_scores,
)
from .onnx_schema import OP_TYPE


def function_proto(fp8_pool: bool = False, tile_elems: int = TILE_ELEMS,
                   shared_macs: int = SHARED_MACS_PER_GATHER) -> onnx.FunctionProto:
    """FunctionProto implementing DSAIndexer (`fp8_pool`: for a uint8 fp8 key pool [NB, BS, Di + 1]; `tile_elems`,
    `shared_macs`: the key tiles, `key_tiles`)."""
    b = FunctionBuilder("dsa")
    shared, tile, count, seq = key_tiles(b, b.dim("q_idx", 1), b.dim("k_new", 1), tile_elems, shared_macs)
    topk = b.attr("topk", "int")
    shape = b.op("Concat", b.op("Shape", "positions"), b.op("Unsqueeze", topk, b.ints([0])), axis=0)  # [T, topk]
    init_values = b.op("Expand", b.float_scalar(float("-inf")), shape)
    init_order = b.op("Expand", b.int_scalar(-1), shape)
    weights = b.op("Unsqueeze", "weights", b.ints([1]))  # [T, 1, Hi]

    def body(sub: FunctionBuilder, i: str, values: list[str]) -> list[str]:
        best, order = values
        span = sub.op("Range", sub.op("Mul", i, tile), sub.op("Mul", sub.op("Add", i, sub.int_scalar(1)), tile),
                      sub.int_scalar(1))  # [C]
        rows = sequence_rows(sub, "k_pool", "k_new", span, fp8_pool)

        def score(s: FunctionBuilder, keys: str, shared_keys: bool) -> str:
            per_head = s.op("Relu", s.op("MatMul", "q_idx", s.op("Transpose", keys, perm=[1, 0] if shared_keys else [0, 2, 1])))
            return s.op("Squeeze", s.op("MatMul", weights, per_head), s.ints([1]))  # [T, X]

        scores, valid, _, cols = tile_scores(sub, shared, seq, span, rows, score)
        scores = sub.op("Where", valid, scores, sub.float_scalar(float("-inf")))
        cols = sub.op("Expand", cols, sub.op("Shape", scores))
        candidates = sub.op("Concat", best, scores, axis=1)
        kept, picked = sub.op("TopK", candidates, sub.op("Unsqueeze", topk, sub.ints([0])), outputs=2, axis=-1,
                              largest=1, sorted=1)
        return [kept, sub.op("GatherElements", sub.op("Concat", order, cols, axis=1), picked, axis=1)]

    best, order = key_loop(b, count, [(init_values, TensorProto.FLOAT), (init_order, TensorProto.INT64)], body)
    b.op("Where", b.op("IsInf", best, detect_positive=0), b.int_scalar(-1), order, out="indices")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["q_idx", "weights", "k_pool", "k_new", "cu_seqlens", "block_tables", "positions"],
        ["indices"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["topk"],
    )

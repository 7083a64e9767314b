"""ONNX Runtime lowering of DSAIndexer: a model-local FunctionProto (domain DOMAIN, same op type) in standard
ONNX (opset 21) that ORT inlines; the TensorRT graph keeps the bare node.

Body (`sparse_mla_attention.ort`'s streaming: one sequence at a time, its whole pool blocks before the chunk in
tiles of about TILE_ELEMS floats, then the rest of its context, the chunk's own keys from `k_new` included, under
the causal mask; fp32 after the gather or the fp8 decode): each tile scored as weights @ relu(q_idx @ keys^T) ([Tn, 1, Hi] x [Tn, Hi, X])
and merged into a running top-k by one TopK(topk) over [running values | the tile's scores] (largest, sorted; ONNX
breaks ties towards the lower index, and the running columns hold lower positions than the tile's, in order: ties go
to the lower position, as the op says; one TopK a tile, not the tile's own and then a merge of the two lists: fewer
nodes a tile, the same selection). No full sort; memory O(Tn x tile), never the context or the pool. -inf picks
(fewer candidates than topk) -> -1.
"""

import onnx
from onnx import TensorProto, helper

from .. import DOMAIN
from ..sparse_mla_attention.ort import ONNX_OPSET, TILE_ELEMS, FunctionBuilder, own_rows, per_sequence, pool_tiles, take_rows
from .onnx_schema import OP_TYPE


def function_proto(fp8_pool: bool = False, tile_elems: int = TILE_ELEMS) -> onnx.FunctionProto:
    """FunctionProto implementing DSAIndexer (`fp8_pool`: for a uint8 fp8 key pool [NB, BS, Di + 1]; `tile_elems`:
    the key tiles, `pool_tiles`)."""
    b = FunctionBuilder("dsa")
    topk = b.attr("topk", "int")
    k = b.op("Unsqueeze", topk, b.ints([0]))
    last = b.op("Sub", k, b.int_scalar(1))
    heads = b.dim("q_idx", 1)
    empty = b.op("Expand", b.int_scalar(-1), b.op("Concat", b.ints([0]), k, axis=0))

    def sequence(sub: FunctionBuilder, seq: dict) -> list[str]:
        q = take_rows(sub, "q_idx", seq)  # [Tn, Hi, Di]
        weights = sub.op("Unsqueeze", take_rows(sub, "weights", seq), sub.ints([1]))  # [Tn, 1, Hi]
        shape = sub.op("Concat", sub.op("Unsqueeze", seq["count"], sub.ints([0])), k, axis=0)  # [Tn, topk]
        init = [(sub.op("Expand", sub.float_scalar(float("-inf")), shape), TensorProto.FLOAT),
                (sub.op("Expand", sub.int_scalar(-1), shape), TensorProto.INT64)]

        def score(s: FunctionBuilder, keys: str) -> str:
            per_head = s.op("Relu", s.op("MatMul", q, s.op("Transpose", keys, perm=[1, 0])))  # [Tn, Hi, X]
            return s.op("Squeeze", s.op("MatMul", weights, per_head), s.ints([1]))  # [Tn, X]

        def merge(s: FunctionBuilder, scores: str, p0: str, values: list[str]) -> list[str]:
            """The best topk of [running | the tile's scores] (positions p0 + column) in one TopK."""
            best, order = values
            kept, picked = s.op("TopK", s.op("Concat", best, scores, axis=1), k, outputs=2, axis=-1, largest=1,
                                sorted=1)
            from_running = s.op("GatherElements", order, s.op("Min", picked, last), axis=1)
            from_tile = s.op("Add", s.op("Sub", picked, k), p0)
            return [kept, s.op("Where", s.op("Less", picked, k), from_running, from_tile)]

        state = pool_tiles(sub, seq, "k_pool", heads, fp8_pool, tile_elems, init,
                           lambda s, keys, p0, p1, values: merge(s, score(s, keys), p0, values))
        keys, causal, first = own_rows(sub, "k_pool", "k_new", seq, fp8_pool)
        masked = sub.op("Where", causal, score(sub, keys), sub.float_scalar(float("-inf")))
        best, order = merge(sub, masked, first, state)
        return [sub.op("Where", sub.op("IsInf", best, detect_positive=0), sub.int_scalar(-1), order)]

    b.op("Identity", per_sequence(b, [(empty, TensorProto.INT64)], sequence)[0], out="indices")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["q_idx", "weights", "k_pool", "k_new", "cu_seqlens", "block_tables", "positions"],
        ["indices"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["topk"],
    )

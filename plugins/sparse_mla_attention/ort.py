"""ONNX Runtime lowering of SparseMLAAttention: a model-local FunctionProto (domain DOMAIN, same op type) whose
body is standard ONNX (opset 21); ORT inlines it. The TensorRT graph keeps the bare node instead.

Body: token -> sequence (compare token ids with cu_seqlens), then `context_rows`: the K indexed latent rows per
token, the step's own positions gathered from `kv_new`, earlier ones with GatherND from the pool at (block of
the sequence's block table, offset in block), cast to fp32 after the gather (fp8 pools: decoded through two
256-entry lookup tables, see `FunctionBuilder.fp8_rows`; cost O(T*K), not O(pool));
scores = q_lat @ rows^T * scale, masked softmax (invalid = index < 0 or > position; a row with nothing valid
gives zeros), o_lat = p @ rows[..., :Dc].

Optional input: an ONNX function cannot branch on whether an optional input was given (ORT's inliner rejects
`Optional`/`OptionalHasElement` on a missing function input, checked with ORT 1.32), so there are two bodies
with the same op type and the same seven formal inputs: `function_proto(dense=False)` reads `topk_indices`
(and, through an `If`, treats K = 0 columns as dense); `function_proto(dense=True)` ignores it. Dense attends
to all positions covered by the step's block tables, 0..B*BS-1 (causality masks the rest), and gathers those
rows once per sequence, not per token (`_dense_attention`): the per-token body materialized [T, B*BS, D] about
seven times per layer, which made a 192-token prefill's three MLA layers ~55% of the step on tiny-k3; now one
Gather hands each token its sequence's rows (memory T*B*BS*(Dc+Dr): the used context, fine for small models).
A model holds one function per op type, so the exporter picks the variant per model; a model mixing dense
and sparse layers uses the sparse body and gives its dense layers an empty [T, 0] (or [0, 0]) index tensor.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper

from moe_export.quantize import fp8_cache

from .. import DOMAIN
from .onnx_schema import OP_TYPE

ONNX_OPSET = 21
_INT64_MAX = 2**63 - 1


class FunctionBuilder:
    """Collects the nodes of a FunctionProto body; every method returns the new value name(s)."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = prefix
        self._count = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs):
        """Append one standard-domain node; returns its output name (or list when outputs > 1).
        `out` names the (single) output, e.g. a function output."""
        self._count += 1
        names = [out] if out else [f"{self._prefix}_{op_type}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def ints(self, values: list[int]) -> str:
        """1-D int64 constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.INT64, [len(values)], values))

    def int_scalar(self, value: int) -> str:
        """0-D int64 constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.INT64, [], [value]))

    def float_scalar(self, value: float) -> str:
        """0-D float constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.FLOAT, [], [value]))

    def attr(self, name: str, kind: str) -> str:
        """0-D constant taken from the calling node's attribute `name`; kind is "float", "int" or "string"."""
        attr_type = {
            "float": onnx.AttributeProto.FLOAT,
            "int": onnx.AttributeProto.INT,
            "string": onnx.AttributeProto.STRING,
        }[kind]
        node = helper.make_node("Constant", [], [f"{self._prefix}_attr_{name}"])
        ref = onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=name, type=attr_type)
        node.attribute.append(ref)
        self.nodes.append(node)
        return node.output[0]

    def dim(self, value: str, axis: int) -> str:
        """0-D int64: size of `value` along `axis`."""
        return self.op("Squeeze", self.op("Shape", value, start=axis, end=axis + 1), self.ints([0]))

    def token_sequences(self, num_tokens: str, cu_seqlens: str) -> str:
        """[T] int64 sequence of each packed token: #{n : cu_seqlens[n+1] <= t}."""
        tokens = self.op("Range", self.int_scalar(0), num_tokens, self.int_scalar(1))
        tail = self.op("Slice", cu_seqlens, self.ints([1]), self.ints([_INT64_MAX]))
        passed = self.op(
            "GreaterOrEqual", self.op("Unsqueeze", tokens, self.ints([1])), self.op("Unsqueeze", tail, self.ints([0]))
        )
        return self.op("ReduceSum", self.op("Cast", passed, to=TensorProto.INT64), self.ints([1]), keepdims=0)

    def context_rows(self, pool: str, new: str, cu_seqlens: str, block_tables: str, positions: str, seq: str,
                     idx: str, fp8_pool: bool = False) -> str:
        """fp32 rows [T, K, D] at positions idx [T, K] (>= 0) of each token's sequence (seq [T]): the step's own
        positions from `new` [T, D], earlier ones from `pool` [NB, BS, D] through the block tables [N, B]
        (`fp8_pool`: a uint8 pool [NB, BS, D + 1] of fp8 rows, decoded after the gather)."""
        first = self.op("Unsqueeze", self.op("Gather", cu_seqlens, seq), self.ints([1]))  # [T, 1]
        start = self.op("Gather", positions, first)  # [T, 1] chunk start position
        own = self.op("GreaterOrEqual", idx, start)
        last_token = self.op("Sub", self.dim(new, 0), self.int_scalar(1))
        new_row = self.op("Clip", self.op("Sub", self.op("Add", first, idx), start), self.int_scalar(0), last_token)
        block_size = self.dim(pool, 1)
        last_col = self.op("Sub", self.dim(block_tables, 1), self.int_scalar(1))
        col = self.op("Clip", self.op("Div", idx, block_size), self.int_scalar(0), last_col)
        tables = self.op("Gather", block_tables, seq, axis=0)  # [T, B]
        block = self.op("Max", self.op("GatherElements", tables, col, axis=1), self.int_scalar(0))  # [T, K]
        where = self.op("Concat", self.op("Unsqueeze", block, self.ints([2])),
                        self.op("Unsqueeze", self.op("Mod", idx, block_size), self.ints([2])), axis=2)  # [T, K, 2]
        gathered = self.op("GatherND", pool, where)
        from_pool = self.fp8_rows(gathered) if fp8_pool else self.op("Cast", gathered, to=TensorProto.FLOAT)
        from_new = self.op("Cast", self.op("Gather", new, new_row, axis=0), to=TensorProto.FLOAT)
        return self.op("Where", self.op("Unsqueeze", own, self.ints([2])), from_new, from_pool)

    def fp8_rows(self, packed: str) -> str:
        """fp32 rows [..., D] from uint8 fp8 rows [..., D + 1] (`moe_export.quantize.fp8_cache`): each E4M3 code
        and the E8M0 scale byte looked up in 256-entry tables, multiplied."""
        def lookup(table, part: str) -> str:
            values = self.op("Constant", value=onnx.numpy_helper.from_array(table, "table"))
            return self.op("Gather", values, self.op("Cast", part, to=TensorProto.INT32), axis=0)

        codes = self.op("Slice", packed, self.ints([0]), self.ints([-1]), self.ints([-1]))
        scale = self.op("Slice", packed, self.ints([-1]), self.ints([_INT64_MAX]), self.ints([-1]))
        return self.op("Mul", lookup(fp8_cache.code_table(), codes), lookup(fp8_cache.scale_table(), scale))

    def masked_softmax(self, scores: str, valid: str, axis: int = -1) -> str:
        """Softmax of `scores` over `axis` where `valid` (broadcast); entries outside get 0, all-invalid rows 0."""
        masked = self.op("Where", valid, scores, self.float_scalar(float("-inf")))
        axes = self.ints([axis])
        row_max = self.op("ReduceMax", masked, axes, keepdims=1)
        row_max = self.op("Where", self.op("IsInf", row_max), self.float_scalar(0.0), row_max)
        expo = self.op("Exp", self.op("Sub", masked, row_max))
        denom = self.op("ReduceSum", expo, axes, keepdims=1)
        denom = self.op("Where", self.op("Greater", denom, self.float_scalar(0.0)), denom, self.float_scalar(1.0))
        return self.op("Div", expo, denom)


def _indexed_attention(b: FunctionBuilder, idx: str, seq: str, scale: str, rank: str, fp8_pool: bool, out: str) -> str:
    """o_lat [T, H, Dc] attending each token to its own positions `idx` [T, K] (-1 or beyond the token: ignored)."""
    q, pool, new, cu, tables, pos = "q_lat", "kv_pool", "kv_new", "cu_seqlens", "block_tables", "positions"
    pos_col = b.op("Unsqueeze", pos, b.ints([1]))
    valid = b.op("And", b.op("GreaterOrEqual", idx, b.int_scalar(0)), b.op("LessOrEqual", idx, pos_col))
    rows = b.context_rows(pool, new, cu, tables, pos, seq, b.op("Max", idx, b.int_scalar(0)), fp8_pool)  # [T, K, Dc+Dr]
    rows = b.op("Where", b.op("Unsqueeze", valid, b.ints([2])), rows, b.float_scalar(0.0))
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", rows, perm=[0, 2, 1])), scale)  # [T, H, K]
    probs = b.masked_softmax(scores, b.op("Unsqueeze", valid, b.ints([1])))
    return b.op("MatMul", probs, b.op("Slice", rows, b.ints([0]), rank, b.ints([2])), out=out)


# Streaming over the keys (dense attention, the DSA indexer): one sequence at a time (a Loop over the step's
# sequences, each one's token results appended), its context in two parts: the whole blocks before its chunk, all in
# the pool and attended by every token of the chunk (no mask needed), read in tiles of C positions (whole blocks
# gathered through its block table, one copy per block), then the rest: the pool rows of the block holding its start
# and its own rows from kv_new [Tn, D], under the causal mask. A
# running state (online softmax; a running top-k) carries over the tiles, so a step's temporaries stay near
# TILE_ELEMS floats whatever the context, and a prefill chunk never shrinks as it grows. Positions after a token,
# and pool rows not written yet, are never read.
TILE_ELEMS = 1 << 21
TILE_POSITIONS = 1 << 15  # at most per tile: a decode step's keys (32k x D fp32: fewer Loop turns than 16k, quiet runs in benchmarks/README)


def key_loop(b: FunctionBuilder, count: str, carried: list[tuple[str, int]], body) -> list[str]:
    """A Loop of `count` iterations carrying `carried` ((initial value, element type) pairs, shapes free to change);
    `body(sub, i, values)` appends iteration i's nodes to `sub` and returns the carried values' next names. Returns
    the final values."""
    sub = FunctionBuilder(f"{b._prefix}_loop{b._count + 1}")
    i, cond = f"{sub._prefix}_i", f"{sub._prefix}_cond"
    values = [f"{sub._prefix}_in{k}" for k in range(len(carried))]
    nexts = [sub.op("Identity", v) for v in body(sub, i, values)]
    cond_out = sub.op("Identity", cond)
    graph = helper.make_graph(
        sub.nodes, sub._prefix,
        [helper.make_tensor_value_info(i, TensorProto.INT64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         *[helper.make_tensor_value_info(v, t, None) for v, (_, t) in zip(values, carried)]],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
         *[helper.make_tensor_value_info(v, t, None) for v, (_, t) in zip(nexts, carried)]])
    b._count += 1
    names = [f"{b._prefix}_Loop_{b._count}_{k}" for k in range(len(carried))]
    b.nodes.append(helper.make_node("Loop", [count, "", *[v for v, _ in carried]], names, body=graph))
    return names


def per_sequence(b: FunctionBuilder, empty: list[tuple[str, int]], body) -> list[str]:
    """Results per token [T, ...], computed one sequence of the step at a time: `body(sub, seq)` returns the
    sequence's results ([Tn, ...] each; `seq` = dict of scalars first, last, count (= Tn), start (its chunk's first
    position, 0 without tokens) and its block table row `table` [B]), appended in order to `empty` (the [0, ...]
    initial values with their element types)."""
    def one(sub: FunctionBuilder, n: str, values: list[str]) -> list[str]:
        first = sub.op("Gather", "cu_seqlens", n)
        last = sub.op("Gather", "cu_seqlens", sub.op("Add", n, sub.int_scalar(1)))
        count = sub.op("Sub", last, first)
        some = sub.op("Greater", count, sub.int_scalar(0))
        at = sub.op("Min", first, sub.op("Sub", sub.dim("positions", 0), sub.int_scalar(1)))
        start = sub.op("Where", some, sub.op("Gather", "positions", at), sub.int_scalar(0))
        seq = dict(first=first, last=last, count=count, start=start, table=sub.op("Gather", "block_tables", n, axis=0))
        return [sub.op("Concat", v, r, axis=0) for v, r in zip(values, body(sub, seq))]

    return key_loop(b, b.op("Sub", b.dim("cu_seqlens", 0), b.int_scalar(1)), empty, one)


def take_rows(b: FunctionBuilder, value: str, seq: dict) -> str:
    """The sequence's tokens' rows of a per-token value [T, ...] -> [Tn, ...]."""
    return b.op("Slice", value, b.op("Unsqueeze", seq["first"], b.ints([0])),
                b.op("Unsqueeze", seq["last"], b.ints([0])), b.ints([0]))


def pool_tiles(b: FunctionBuilder, seq: dict, pool: str, heads: str, fp8_pool: bool, tile_elems: int,
               carried: list[tuple[str, int]], body) -> list[str]:
    """Loop over the sequence's whole pool blocks before its chunk (positions [0, start // BS x BS)) in tiles of C
    positions, C a multiple of the block size near tile_elems / max(Tn x heads, row width), at most TILE_POSITIONS:
    `body(sub, keys, p0, p1,
    values)` merges the tile's fp32 rows `keys` [p1 - p0, D] (positions p0 .. p1-1; fp8 pools decoded) into the
    carried values. The partial block before the chunk is `own_rows`'."""
    block_size = b.dim(pool, 1)
    width = b.dim(pool, 2)
    per_position = b.op("Max", b.op("Mul", seq["count"], heads), width)
    positions = b.op("Min", b.op("Div", b.int_scalar(tile_elems), per_position), b.int_scalar(TILE_POSITIONS))
    blocks_per_tile = b.op("Max", b.op("Div", positions, block_size), b.int_scalar(1))
    full_blocks = b.op("Div", seq["start"], block_size)
    tiles = b.op("Div", b.op("Sub", b.op("Add", full_blocks, blocks_per_tile), b.int_scalar(1)), blocks_per_tile)
    row_shape = b.op("Concat", b.ints([-1]), b.op("Shape", pool, start=2), axis=0)

    def tile(sub: FunctionBuilder, i: str, values: list[str]) -> list[str]:
        first_block = sub.op("Mul", i, blocks_per_tile)
        end_block = sub.op("Min", sub.op("Add", first_block, blocks_per_tile), full_blocks)
        blocks = sub.op("Slice", seq["table"], sub.op("Unsqueeze", first_block, sub.ints([0])),
                        sub.op("Unsqueeze", end_block, sub.ints([0])), sub.ints([0]))
        rows = sub.op("Reshape", sub.op("Gather", pool, sub.op("Max", blocks, sub.int_scalar(0)), axis=0), row_shape)
        keys = sub.fp8_rows(rows) if fp8_pool else sub.op("Cast", rows, to=TensorProto.FLOAT)  # [X, D]
        return body(sub, keys, sub.op("Mul", first_block, block_size), sub.op("Mul", end_block, block_size), values)

    return key_loop(b, tiles, carried, tile)


def own_rows(b: FunctionBuilder, pool: str, new: str, seq: dict, fp8_pool: bool) -> tuple[str, str, str]:
    """What the chunk reads beyond `pool_tiles`: (rows [R + Tn, D] fp32: the R = start mod BS pool rows of the block
    holding its start, then its own rows from `new`; the mask [Tn, R + Tn] (token i reads every pool row and own row
    j <= i); the first row's position, start - R)."""
    block_size = b.dim(pool, 1)
    full = b.op("Mul", b.op("Div", seq["start"], block_size), block_size)
    partial = b.op("Sub", seq["start"], full)
    block = b.op("Max", b.op("Gather", seq["table"], b.op("Div", seq["start"], block_size)), b.int_scalar(0))
    rows = b.op("Slice", b.op("Gather", pool, block, axis=0), b.ints([0]), b.op("Unsqueeze", partial, b.ints([0])),
                b.ints([0]))  # [R, D] (fp8: D + 1 bytes)
    rows = b.fp8_rows(rows) if fp8_pool else b.op("Cast", rows, to=TensorProto.FLOAT)
    keys = b.op("Concat", rows, b.op("Cast", take_rows(b, new, seq), to=TensorProto.FLOAT), axis=0)
    steps = b.op("Range", b.int_scalar(0), seq["count"], b.int_scalar(1))
    cols = b.op("Range", b.op("Sub", b.int_scalar(0), partial), seq["count"], b.int_scalar(1))
    mask = b.op("LessOrEqual", b.op("Unsqueeze", cols, b.ints([0])), b.op("Unsqueeze", steps, b.ints([1])))
    return keys, mask, full


def _dense_attention(b: FunctionBuilder, scale: str, rank: str, fp8_pool: bool, out: str, tile_elems: int) -> str:
    """o_lat [T, H, Dc] attending each token to every position 0..pos of its sequence, per sequence over its pool
    tiles and then its own rows (`pool_tiles`, `own_rows`), with an online softmax: running max m [Tn, H, 1] (from
    the lowest finite float, so no inf - inf), denominator l and weighted sum acc [Tn, H, Dc+Dr] (whole rows: no copy
    of a tile's latent part; o_lat is its first Dc values), rescaled by
    exp(m_old - m_new) per tile. A token attends at least to itself, so l > 0 at the end."""
    heads = b.dim("q_lat", 1)
    empty = b.op("Expand", b.float_scalar(0.0), b.op("Concat", b.ints([0]), b.op("Shape", "q_lat", start=1, end=2),
                                                      rank, axis=0))
    lowest = float(np.finfo(np.float32).min)

    def sequence(sub: FunctionBuilder, seq: dict) -> list[str]:
        q = take_rows(sub, "q_lat", seq)  # [Tn, H, D]
        rows_shape = sub.op("Concat", sub.op("Shape", q, start=0, end=2), sub.ints([1]), axis=0)
        acc_shape = sub.op("Shape", q)  # the weighted sum of whole rows; its first Dc values are o_lat
        init = [(sub.op("Expand", sub.float_scalar(lowest), rows_shape), TensorProto.FLOAT),
                (sub.op("Expand", sub.float_scalar(0.0), rows_shape), TensorProto.FLOAT),
                (sub.op("Expand", sub.float_scalar(0.0), acc_shape), TensorProto.FLOAT)]

        def merge(s: FunctionBuilder, scores: str, keys: str, values: list[str]) -> list[str]:
            m, l, acc = values
            m_new = s.op("Max", m, s.op("ReduceMax", scores, s.ints([-1]), keepdims=1))
            corr = s.op("Exp", s.op("Sub", m, m_new))
            probs = s.op("Exp", s.op("Sub", scores, m_new))  # masked: exp(-inf) = 0
            l_new = s.op("Add", s.op("Mul", l, corr), s.op("ReduceSum", probs, s.ints([-1]), keepdims=1))
            return [m_new, l_new, s.op("Add", s.op("Mul", acc, corr), s.op("MatMul", probs, keys))]

        def score(s: FunctionBuilder, keys: str) -> str:
            return s.op("Mul", s.op("MatMul", q, s.op("Transpose", keys, perm=[1, 0])), scale)  # [Tn, H, X]

        state = pool_tiles(sub, seq, "kv_pool", heads, fp8_pool, tile_elems, init,
                           lambda s, keys, p0, p1, values: merge(s, score(s, keys), keys, values))
        keys, causal, _ = own_rows(sub, "kv_pool", "kv_new", seq, fp8_pool)
        masked = sub.op("Where", sub.op("Unsqueeze", causal, sub.ints([1])), score(sub, keys),
                        sub.float_scalar(float("-inf")))
        _, l, acc = merge(sub, masked, keys, state)
        return [sub.op("Div", sub.op("Slice", acc, sub.ints([0]), rank, sub.ints([2])), l)]

    return b.op("Identity", per_sequence(b, [(empty, TensorProto.FLOAT)], sequence)[0], out=out)


def _branch(name: str, build) -> onnx.GraphProto:
    """If-branch (reading outer-scope values) whose nodes `build(builder, out)` appends; returns [T, H, Dc]."""
    b = FunctionBuilder(name)
    build(b, f"{name}_o_lat")
    out = helper.make_tensor_value_info(f"{name}_o_lat", TensorProto.FLOAT, [None, None, None])
    return helper.make_graph(b.nodes, name, [], [out])


def function_proto(dense: bool = False, fp8_pool: bool = False, tile_elems: int = TILE_ELEMS) -> onnx.FunctionProto:
    """FunctionProto for SparseMLAAttention; `dense=True` gives the body that ignores `topk_indices`, `fp8_pool`
    the body for a uint8 fp8 pool [NB, BS, Dc+Dr+1]; `tile_elems`: the dense path's key tiles (`pool_tiles`)."""
    b = FunctionBuilder("smla")
    scale = b.attr("scale", "float")
    rank = b.op("Unsqueeze", b.attr("kv_lora_rank", "int"), b.ints([0]))
    if dense:
        _dense_attention(b, scale, rank, fp8_pool, "o_lat", tile_elems)
    else:
        seq = b.token_sequences(b.dim("q_lat", 0), "cu_seqlens")
        all_pos = _branch("smla_dense", lambda sub, out: _dense_attention(sub, scale, rank, fp8_pool, out, tile_elems))
        given = _branch("smla_given", lambda sub, out: _indexed_attention(sub, "topk_indices", seq, scale, rank,
                                                                          fp8_pool, out))
        no_cols = b.op("Equal", b.dim("topk_indices", 1), b.int_scalar(0))
        b.op("If", no_cols, then_branch=all_pos, else_branch=given, out="o_lat")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["q_lat", "kv_pool", "kv_new", "cu_seqlens", "block_tables", "positions", "topk_indices"],
        ["o_lat"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["scale", "kv_lora_rank"],
    )

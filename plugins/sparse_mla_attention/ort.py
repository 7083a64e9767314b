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


def sequence_rows(b: FunctionBuilder, pool: str, new: str, span: str, fp8_pool: bool) -> str:
    """fp32 rows [N, C, D] of every sequence of the step at positions `span` [C] (>= 0): before a sequence's
    chunk start from `pool` [NB, BS, D] through its block table, from it on from `new` [T, D]; zero beyond its last
    token (and for a sequence without tokens), so that what no token may read is never NaN and masked positions
    contribute exact zeros."""
    cu, tables, pos = "cu_seqlens", "block_tables", "positions"
    block_size = b.dim(pool, 1)
    span_row = b.op("Unsqueeze", span, b.ints([0]))  # [1, C]
    # per sequence: first token in the step and chunk start (one padding entry: an empty last sequence's first
    # token is T)
    pos_pad = b.op("Concat", pos, b.ints([0]), axis=0)  # [T + 1]
    head = b.op("Slice", cu, b.ints([0]), b.ints([-1]))  # [N]
    start = b.op("Unsqueeze", b.op("Gather", pos_pad, head), b.ints([1]))  # [N, 1]
    own = b.op("GreaterOrEqual", span_row, start)  # [N, C] the step's own rows, from kv_new
    new_row = b.op("Clip", b.op("Sub", b.op("Add", b.op("Unsqueeze", head, b.ints([1])), span_row), start),
                   b.int_scalar(0), b.dim(new, 0))  # [N, C] into kv_new plus one zero row
    width = b.op("Shape", new, start=1, end=2)
    zero_row = b.op("Expand", b.float_scalar(0.0), b.op("Concat", b.ints([1]), width, axis=0))
    new_pad = b.op("Concat", b.op("Cast", new, to=TensorProto.FLOAT), zero_row, axis=0)  # [T + 1, D]
    last_col = b.op("Sub", b.dim(tables, 1), b.int_scalar(1))
    col = b.op("Min", b.op("Div", span, block_size), last_col)
    block = b.op("Max", b.op("Gather", tables, col, axis=1), b.int_scalar(0))  # [N, C]
    offset = b.op("Expand", b.op("Mod", span_row, block_size), b.op("Shape", block))
    where = b.op("Concat", b.op("Unsqueeze", block, b.ints([2])), b.op("Unsqueeze", offset, b.ints([2])), axis=2)
    gathered = b.op("GatherND", pool, where)  # [N, C, D] (fp8: D + 1 bytes)
    from_pool = b.fp8_rows(gathered) if fp8_pool else b.op("Cast", gathered, to=TensorProto.FLOAT)
    rows = b.op("Where", b.op("Unsqueeze", own, b.ints([2])), b.op("Gather", new_pad, new_row, axis=0), from_pool)
    length = b.op("Unsqueeze", b.op("Sub", b.op("Slice", cu, b.ints([1]), b.ints([_INT64_MAX])), head), b.ints([1]))
    end = b.op("Where", b.op("Greater", length, b.int_scalar(0)), b.op("Add", start, length), b.int_scalar(0))
    return b.op("Where", b.op("Unsqueeze", b.op("Less", span_row, end), b.ints([2])), rows, b.float_scalar(0.0))


# Streaming over the keys (dense attention, the DSA indexer): the context is read in tiles of C positions with a
# running state (online softmax; a running top-k), so a step's temporaries are about TILE_ELEMS floats whatever
# the context, and a prefill chunk never shrinks as it grows. Two forms of a tile, chosen per step:
#   - shared: the tile's rows of every sequence [N*C, D] scored by every token with one matmul ([T, H, N*C]; a token's
#     other sequences are masked), so a sequence's rows are read once for all its tokens (a prefill chunk);
#   - per token: each token's own sequence's rows [T, C, D] (a Gather), as many sequences as tokens (decode).
# Shared costs (N - 1) x T x H x D extra multiply-adds per key position, per token T x D gathered values; shared is
# used while (N - 1) x H <= SHARED_MACS_PER_GATHER (a gathered fp32 value moved through memory costs about that
# many multiply-adds of a matmul).
TILE_ELEMS = 1 << 23
SHARED_MACS_PER_GATHER = 8


def key_tiles(b: FunctionBuilder, heads: str, width: str, tile_elems: int, shared_macs: int) -> tuple[str, str, str, str]:
    """(shared: bool scalar, tile C, number of tiles, seq [T] each token's sequence) of a step whose scores have
    `heads` rows per token and whose rows `width` values: C keeps the tile's largest temporary near `tile_elems`
    floats (shared: [T, heads, N*C] and [N, C, width]; per token: [T, C, max(heads, width)]); the tiles cover
    positions 0..(the step's last position)."""
    num_tokens, num_seqs = b.dim("positions", 0), b.op("Sub", b.dim("cu_seqlens", 0), b.int_scalar(1))
    seq = b.token_sequences(num_tokens, "cu_seqlens")
    extra = b.op("Mul", b.op("Sub", num_seqs, b.int_scalar(1)), heads)
    shared = b.op("LessOrEqual", extra, b.int_scalar(shared_macs))
    per_col = b.op("Where", shared, b.op("Max", b.op("Mul", b.op("Mul", num_tokens, num_seqs), heads),
                                         b.op("Mul", num_seqs, width)),
                   b.op("Mul", num_tokens, b.op("Max", heads, width)))
    length = b.op("Add", b.op("ReduceMax", b.op("Concat", "positions", b.ints([0]), axis=0), keepdims=0),
                  b.int_scalar(1))
    tile = b.op("Min", b.op("Max", b.op("Div", b.int_scalar(tile_elems), b.op("Max", per_col, b.int_scalar(1))),
                            b.int_scalar(1)), length)
    count = b.op("Div", b.op("Sub", b.op("Add", length, tile), b.int_scalar(1)), tile)
    return shared, tile, count, seq


def tile_scores(b: FunctionBuilder, shared: str, seq: str, span: str, rows: str, score) -> tuple[str, str, str, str]:
    """(scores [T, ..., X], valid [T, X] (the token's own sequence, causal), rows [X, D] or [T, X, D], their
    positions [1, X]) of one key tile
    whose rows of every sequence are `rows` [N, C, D] at positions `span` [C]; `score(sub, keys, shared)` scores the
    tokens against keys [X, D] (shared) or [T, X, D] in builder `sub`."""
    def branch(name: str, build) -> onnx.GraphProto:
        sub = FunctionBuilder(name)
        outs = build(sub)
        types = (TensorProto.FLOAT, TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64)
        return helper.make_graph(sub.nodes, name, [], [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)])

    pos_col = b.op("Unsqueeze", "positions", b.ints([1]))  # [T, 1]

    def across(sub: FunctionBuilder) -> list[str]:
        width = sub.op("Shape", rows, start=2, end=3)
        keys = sub.op("Reshape", rows, sub.op("Concat", sub.ints([-1]), width, axis=0))  # [N*C, D]
        n_seq = sub.op("Shape", rows, start=0, end=1)
        col_seq = sub.op("Reshape", sub.op("Expand", sub.op("Unsqueeze", sub.op("Range", sub.int_scalar(0),
                         sub.op("Squeeze", n_seq, sub.ints([0])), sub.int_scalar(1)), sub.ints([1])),
                         sub.op("Concat", n_seq, sub.op("Shape", span), axis=0)), sub.ints([1, -1]))  # [1, N*C]
        col_pos = sub.op("Reshape", sub.op("Expand", sub.op("Unsqueeze", span, sub.ints([0])),
                                           sub.op("Concat", n_seq, sub.op("Shape", span), axis=0)), sub.ints([1, -1]))
        valid = sub.op("And", sub.op("Equal", col_seq, sub.op("Unsqueeze", seq, sub.ints([1]))),
                       sub.op("LessOrEqual", col_pos, pos_col))
        return [sub.op("Identity", score(sub, keys, True)), valid, sub.op("Identity", keys), col_pos]

    def per_token(sub: FunctionBuilder) -> list[str]:
        keys = sub.op("Gather", rows, seq, axis=0)  # [T, C, D]
        valid = sub.op("LessOrEqual", sub.op("Unsqueeze", span, sub.ints([0])), pos_col)
        return [sub.op("Identity", score(sub, keys, False)), valid, sub.op("Identity", keys),
                sub.op("Unsqueeze", span, sub.ints([0]))]

    return b.op("If", shared, then_branch=branch(f"{b._prefix}_shared", across),
                else_branch=branch(f"{b._prefix}_per_token", per_token), outputs=4)


def key_loop(b: FunctionBuilder, count: str, carried: list[tuple[str, int]], body) -> list[str]:
    """A Loop over `count` key tiles carrying `carried` ((initial value, element type) pairs); `body(sub, i,
    values)` appends tile i's nodes to `sub` and returns the carried values' next names. Returns the final values."""
    sub = FunctionBuilder(f"{b._prefix}_tile")
    i, cond = f"{b._prefix}_i", f"{b._prefix}_cond"
    values = [f"{b._prefix}_carried_{k}" for k in range(len(carried))]
    nexts = [sub.op("Identity", v) for v in body(sub, i, values)]
    cond_out = sub.op("Identity", cond)
    graph = helper.make_graph(
        sub.nodes, f"{b._prefix}_tile",
        [helper.make_tensor_value_info(i, TensorProto.INT64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         *[helper.make_tensor_value_info(v, t, None) for v, (_, t) in zip(values, carried)]],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
         *[helper.make_tensor_value_info(v, t, None) for v, (_, t) in zip(nexts, carried)]])
    b._count += 1
    names = [f"{b._prefix}_Loop_{b._count}_{k}" for k in range(len(carried))]
    b.nodes.append(helper.make_node("Loop", [count, "", *[v for v, _ in carried]], names, body=graph))
    return names


def _dense_attention(b: FunctionBuilder, scale: str, rank: str, fp8_pool: bool, out: str, tile_elems: int,
                     shared_macs: int) -> str:
    """o_lat [T, H, Dc] attending each token to every position 0..pos of its sequence, streaming over key tiles
    with an online softmax: running max m [T, H, 1] (from the lowest finite float, so no inf - inf), denominator
    l and weighted sum acc [T, H, Dc], rescaled by exp(m_old - m_new) per tile. A token attends at least to
    itself, so l > 0 at the end."""
    q = "q_lat"
    shared, tile, count, seq = key_tiles(b, b.dim(q, 1), b.dim("kv_new", 1), tile_elems, shared_macs)
    rows_shape = b.op("Concat", b.op("Shape", q, start=0, end=2), b.ints([1]), axis=0)  # [T, H, 1]
    acc_shape = b.op("Concat", b.op("Shape", q, start=0, end=2), rank, axis=0)
    lowest = float(np.finfo(np.float32).min)
    init_m = b.op("Expand", b.float_scalar(lowest), rows_shape)
    init_l = b.op("Expand", b.float_scalar(0.0), rows_shape)
    init_acc = b.op("Expand", b.float_scalar(0.0), acc_shape)

    def body(sub: FunctionBuilder, i: str, values: list[str]) -> list[str]:
        m, l, acc = values
        span = sub.op("Range", sub.op("Mul", i, tile), sub.op("Mul", sub.op("Add", i, sub.int_scalar(1)), tile),
                      sub.int_scalar(1))  # [C]
        rows = sequence_rows(sub, "kv_pool", "kv_new", span, fp8_pool)

        def score(s: FunctionBuilder, keys: str, shared_keys: bool) -> str:
            perm = [1, 0] if shared_keys else [0, 2, 1]
            return s.op("Mul", s.op("MatMul", q, s.op("Transpose", keys, perm=perm)), scale)  # [T, H, X]

        scores, valid, keys, _ = tile_scores(sub, shared, seq, span, rows, score)
        masked = sub.op("Where", sub.op("Unsqueeze", valid, sub.ints([1])), scores, sub.float_scalar(float("-inf")))
        m_new = sub.op("Max", m, sub.op("ReduceMax", masked, sub.ints([-1]), keepdims=1))
        corr = sub.op("Exp", sub.op("Sub", m, m_new))
        probs = sub.op("Exp", sub.op("Sub", masked, m_new))  # masked: exp(-inf) = 0
        l_new = sub.op("Add", sub.op("Mul", l, corr), sub.op("ReduceSum", probs, sub.ints([-1]), keepdims=1))
        values_c = sub.op("Slice", keys, sub.ints([0]), rank, sub.ints([-1]))  # [X, Dc] or [T, X, Dc]
        acc_new = sub.op("Add", sub.op("Mul", acc, corr), sub.op("MatMul", probs, values_c))
        return [m_new, l_new, acc_new]

    _, l, acc = key_loop(b, count, [(init_m, TensorProto.FLOAT), (init_l, TensorProto.FLOAT),
                                     (init_acc, TensorProto.FLOAT)], body)
    return b.op("Div", acc, l, out=out)


def _branch(name: str, build) -> onnx.GraphProto:
    """If-branch (reading outer-scope values) whose nodes `build(builder, out)` appends; returns [T, H, Dc]."""
    b = FunctionBuilder(name)
    build(b, f"{name}_o_lat")
    out = helper.make_tensor_value_info(f"{name}_o_lat", TensorProto.FLOAT, [None, None, None])
    return helper.make_graph(b.nodes, name, [], [out])


def function_proto(dense: bool = False, fp8_pool: bool = False, tile_elems: int = TILE_ELEMS,
                   shared_macs: int = SHARED_MACS_PER_GATHER) -> onnx.FunctionProto:
    """FunctionProto for SparseMLAAttention; `dense=True` gives the body that ignores `topk_indices`, `fp8_pool`
    the body for a uint8 fp8 pool [NB, BS, Dc+Dr+1]; `tile_elems`, `shared_macs`: the dense path's key tiles
    (`key_tiles`)."""
    b = FunctionBuilder("smla")
    scale = b.attr("scale", "float")
    rank = b.op("Unsqueeze", b.attr("kv_lora_rank", "int"), b.ints([0]))
    if dense:
        _dense_attention(b, scale, rank, fp8_pool, "o_lat", tile_elems, shared_macs)
    else:
        seq = b.token_sequences(b.dim("q_lat", 0), "cu_seqlens")
        all_pos = _branch("smla_dense", lambda sub, out: _dense_attention(sub, scale, rank, fp8_pool, out, tile_elems,
                                                                          shared_macs))
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

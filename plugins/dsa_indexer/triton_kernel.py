"""Triton DSAIndexer (semantics in `reference.py`): scores on the tensor cores, then a radix select in a kernel.

`_index_scores_kernel` writes the index scores of a chunk of tokens x positions (one program per token and run
of BLOCK_N-position blocks: the token's [Hi, Di] queries are loaded once and multiplied with each [BLOCK_N, Di]
key tile by `tl.dot`, relu, head-weighted sum; positions beyond the token get -inf and blocks wholly beyond it
load nothing). Keys of earlier steps come from the paged pool (reached through the pool table,
`plugins/pool_table.py`) through the sequence's block table, the step's own from `k_new`. Precision follows the
pool, as in SparseMLA: bf16 and fp8 pools give bf16 operands (q rounded to bf16; fp8 codes converted exactly,
their per-row E8M0 scale applied to the row's dot products) with fp32 accumulation; fp32 / fp16 pools three
tf32 products per fp32 one (`input_precision="tf32x3"`, about fp32's accuracy; exact fp32 in the interpreter).

`_select_topk_kernel` keeps each token's `topk` best without sorting its row (one program per token): the
candidates are the token's running best (`topk` values with their positions) and the chunk's scores; four
8-bit radix passes (histograms of the order-preserving integer of each fp32 score) find the topk-th best value,
one pass compacts the candidates above it plus the first ones equal to it (lowest positions: the op's tie rule),
and only those `topk` are sorted (by score desc, position asc) into the running best. The indices written are -1
where fewer candidates exist (a -inf score). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

`dsa_indexer_launch` bounds its memory and never synchronizes with the host: the candidate positions span the
block table's capacity (B * BS, from shapes; not max(positions), which would be read back), and scores are made
and selected in chunks of tokens x positions (`chunked_topk`), so scratch stays near `budget_bytes`
(`sizes.workspace_bytes`) at any context length.
"""

import torch
import triton
import triton.language as tl

from ..pool_table import TRITON_DTYPES, check_pool_offsets, in_pool, pool_entry, pool_table
from ..sparse_mla_attention.inputs import token_sequences
from ..sparse_mla_attention.triton_kernel import e8m0_scale, fp8_codes
from ..triton_dot import INTERPRETED, mma
from .inputs import indexer_inputs
from .sizes import DEFAULT_SCRATCH_BUDGET, SELECT_BLOCK, blocks_per_program, chunk_shape, padded_topk

SCORE_WARPS = 8


def score_tiles(pool_dtype: torch.dtype, block_size: int, block_n: int) -> tuple[int, int]:
    """(BLOCK_N, stages) of the score kernel, as compiled for sm_90 without spills: bf16 rows pipelined 3 deep
    (asynchronous copies), fp32 / fp16 2; fp8 rows (DI + 1 bytes, byte loads) unpipelined, in tiles of at most
    32 positions unless a tile lies in one cache block."""
    if pool_dtype == torch.uint8:
        return (block_n if block_size % block_n == 0 else min(block_n, 32)), 1
    return block_n, 3 if pool_dtype == torch.bfloat16 else 2


@triton.jit
def _score_tile(q, w, pool_ptr, pool_ok, num_blocks, new_ptr, table, out_row, c, col0, pos, first, chunk_start,
                out_len, block_size, DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, POOL_FP8: tl.constexpr, DOT_BF16: tl.constexpr, UPCAST: tl.constexpr,
                OWN: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """Scores of columns c..c+BLOCK_N-1 (positions col0 + column) into out_row; OWN: the tile may hold the
    step's own positions (read from `new`), else only pool rows. ONE_BLOCK: the tile's positions lie in one
    cache block (block_size a multiple of BLOCK_N), so its rows are one contiguous run of the pool at one
    scalar address (fixed offsets from it: few address registers, even for fp8 rows of DI + 1 bytes)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DI
    offs_c = c + tl.arange(0, BLOCK_N)
    offs_n = col0 + offs_c
    valid = offs_n <= pos
    past = in_pool(valid & (offs_n < chunk_start), pool_ok)
    if ONE_BLOCK:
        block = tl.load(table + (col0 + c) // block_size).to(tl.int64)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
        tile = pool_ptr + (block * block_size + (col0 + c) % block_size) * (DI + POOL_FP8)
        rows = tile + tl.arange(0, BLOCK_N) * (DI + POOL_FP8)  # [BLOCK_N] row pointers
    else:
        block = tl.load(table + offs_n // block_size, mask=past, other=0).to(tl.int64)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
        rows = pool_ptr + (block * block_size + offs_n % block_size) * (DI + POOL_FP8)
    k = tl.load(rows[:, None] + offs_d[None, :], mask=past[:, None] & mask_d[None, :], other=0)
    k_dtype = tl.bfloat16 if DOT_BF16 else tl.float32
    if POOL_FP8:
        k = fp8_codes(k, k_dtype)
        row_scale = e8m0_scale(tl.load(rows + DI, mask=past, other=127))
    else:
        k = k.to(k_dtype)
        row_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    if OWN:
        own = valid & (offs_n >= chunk_start)
        new = tl.load(new_ptr + (first + offs_n - chunk_start)[:, None] * DI + offs_d[None, :],
                      mask=own[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        k = tl.where(own[:, None], new.to(k_dtype), k)
        row_scale = tl.where(own, 1.0, row_scale)
    if DOT_BF16:
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST)  # [BLOCK_H, BLOCK_N]
    else:  # three tf32 products per fp32 one: about fp32's accuracy, on the tensor cores
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    s = tl.maximum(s * row_scale[None, :], 0.0)
    score = tl.where(valid, tl.sum(s * w[:, None], axis=0), float("-inf"))
    tl.store(out_row + offs_c, score, mask=offs_c < out_len)


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, pool_table_ptr, new_ptr, seq_ptr, cu_ptr, tables_ptr, pos_ptr, out_ptr,
    pool_index, num_heads, out_len, block_size, table_width, t0, col0, steps,
    stride_qt, stride_qh, stride_wt, stride_ot,
    DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    POOL_FP8: tl.constexpr, POOL_DTYPE: tl.constexpr, DOT_BF16: tl.constexpr, UPCAST: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """Scores of token t0 + program_id(0) against positions col0 + columns [c, c + steps * BLOCK_N) of
    out_len, c = program_id(1) * steps * BLOCK_N, into row program_id(0) of out. The key pool [NB, block_size,
    DI (+1 if POOL_FP8)] of POOL_DTYPE is row `pool_index` of the pool table (NB its capacity: block ids are
    clamped into it; an invalid row reads no pool memory). Three loops: tiles of earlier positions only (pool
    rows), tiles reaching the step's own positions (pool and `new` rows), tiles beyond the token (-inf)."""
    pool_ptr, num_blocks, pool_ok = pool_entry(pool_table_ptr, pool_index, POOL_DTYPE)
    pool_ptr = tl.multiple_of(pool_ptr, 16)  # `pool_entry` masks every access unless the address is 16-byte aligned
    t = t0 + tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & (offs_d < DI)[None, :], other=0.0)  # fmt: skip
    q = q.to(tl.bfloat16 if DOT_BF16 else tl.float32)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=mask_h, other=0.0)
    seq = tl.load(seq_ptr + t)
    first = tl.load(cu_ptr + seq)
    chunk_start = tl.load(pos_ptr + first)
    table = tables_ptr + seq * table_width
    out_row = out_ptr + tl.program_id(0) * stride_ot
    begin = tl.program_id(1) * steps * BLOCK_N
    end = tl.minimum(out_len, begin + steps * BLOCK_N)
    live = tl.maximum(tl.minimum(end, pos - col0 + 1), begin)  # columns from `live` on are beyond the token
    pool_only = begin + tl.maximum(tl.minimum(live, chunk_start - col0) - begin, 0) // BLOCK_N * BLOCK_N
    for c in range(begin, pool_only, BLOCK_N):
        _score_tile(q, w, pool_ptr, pool_ok, num_blocks, new_ptr, table, out_row, c, col0, pos, first, chunk_start,
                    out_len, block_size, DI, BLOCK_H, BLOCK_D, BLOCK_N, POOL_FP8, DOT_BF16, UPCAST, False, ONE_BLOCK)  # fmt: skip
    for c in range(pool_only, live, BLOCK_N):
        _score_tile(q, w, pool_ptr, pool_ok, num_blocks, new_ptr, table, out_row, c, col0, pos, first, chunk_start,
                    out_len, block_size, DI, BLOCK_H, BLOCK_D, BLOCK_N, POOL_FP8, DOT_BF16, UPCAST, True, ONE_BLOCK)  # fmt: skip
    for c in range(begin + tl.cdiv(live - begin, BLOCK_N) * BLOCK_N, end, BLOCK_N):
        offs_c = c + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_c, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_c < out_len)


@triton.jit
def _order_key(v):
    """fp32 -> int64 in [0, 2^32) ordered as the floats (-0 as +0: they tie; NaN above +inf as torch sorts it)."""
    b = tl.where(v == 0, 0.0, v).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _candidates(vals_ptr, idx_ptr, scores_ptr, j, topk, n, c0):
    """(order keys, positions, in range) of candidates j [BLOCK] of a token: j < topk its running best
    (vals / idx), then its chunk scores at positions c0 + j - topk (j < topk + n)."""
    running = j < topk
    fresh = (j >= topk) & (j < topk + n)
    v = tl.where(running, tl.load(vals_ptr + j, mask=running, other=0.0),
                 tl.load(scores_ptr + j - topk, mask=fresh, other=0.0))  # fmt: skip
    p = tl.where(running, tl.load(idx_ptr + j, mask=running, other=-1), c0 + j - topk)
    return _order_key(v), p, running | fresh


@triton.jit
def _select_topk_kernel(vals_ptr, idx_ptr, scores_ptr, sel_ptr, topk, n, c0, stride_v, stride_i, stride_s,
                        KP: tl.constexpr, BLOCK: tl.constexpr):
    """Token program_id(0): its running best vals [topk] fp32 / idx [topk] int64 (best first) merged with its
    chunk's scores [n] (positions c0..c0+n-1, all above the running ones), in place; sel [KP] int64 scratch."""
    row = tl.program_id(0).to(tl.int64)
    vals_ptr += row * stride_v
    idx_ptr += row * stride_i
    scores_ptr += row * stride_s
    sel_ptr += row * KP
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    total = topk + n
    prefix = tl.zeros([], tl.int64)  # the bits of the topk-th best key found so far
    need = topk  # how many of the keys matching `prefix` are still to be taken
    for shift in tl.static_range(24, -8, -8):
        hist = tl.zeros([256], tl.int32)
        for start in range(0, total, BLOCK):
            key, _, ok = _candidates(vals_ptr, idx_ptr, scores_ptr, start + offs, topk, n, c0)
            alive = ok & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=alive)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys matching with this digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix * 256 + digit
    taken = 0
    equal_seen = 0
    for start in range(0, total, BLOCK):
        key, p, ok = _candidates(vals_ptr, idx_ptr, scores_ptr, start + offs, topk, n, c0)
        equal = ok & (key == prefix)
        rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - equal.to(tl.int32)
        take = (ok & (key > prefix)) | (equal & (rank < need))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - take.to(tl.int32)
        # sort key: score desc, then position asc (-1 padding last): (key - 2^31) << 32 | (2^32 - 2 - p)
        tl.store(sel_ptr + slot, ((key - 2147483648) << 32) | (4294967294 - p), mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        equal_seen += tl.sum(equal.to(tl.int32), 0)
    tl.debug_barrier()  # the compacted keys, written by every thread, read back by the sort
    offs_k = tl.arange(0, KP)
    best = tl.sort(tl.load(sel_ptr + offs_k, mask=offs_k < topk, other=-9223372036854775808), descending=True)
    b = (best >> 32).to(tl.int32)
    v = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    p = 4294967294 - (best & 4294967295)
    tl.store(vals_ptr + offs_k, v, mask=offs_k < topk)
    tl.store(idx_ptr + offs_k, tl.where(v == float("-inf"), -1, p), mask=offs_k < topk)


class _Buffers:
    """The chunk buffers, carved from a uint8 workspace (or allocated when none is given)."""

    def __init__(self, workspace: torch.Tensor | None, tc: int, lc: int, topk: int, device):
        sizes = {"scores": (torch.float32, tc * lc), "vals": (torch.float32, tc * topk),
                 "sel": (torch.int64, tc * padded_topk(topk))}  # fmt: skip
        offset = 0
        for name, (dtype, count) in sizes.items():
            width = dtype.itemsize
            if workspace is None:
                buf = torch.empty(count, dtype=dtype, device=device)
            else:
                if workspace.numel() < offset + width * count:
                    raise ValueError(f"DSAIndexer workspace of {workspace.numel()} bytes is too small")
                buf = workspace[offset : offset + width * count].view(dtype)
                offset += -(-(width * count) // 256) * 256
            setattr(self, name, buf)


def chunked_topk(score_chunk, num_tokens: int, length: int, topk: int, chunk: tuple[int, int], device,
                 out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[T, topk] int64 best positions (-1 where fewer candidates) over positions 0..length-1, the scores made
    by `score_chunk(t0, t1, c0, c1, buffer)` -> [t1-t0, c1-c0] fp32 with contiguous rows (-inf = not a
    candidate; `buffer` is a flat fp32 buffer it may write them into), chunk by chunk: `_select_topk_kernel`
    merges each chunk into the running best (held in `out`), ties to the lower position. Every buffer comes
    from `workspace` when given."""
    tc, lc = chunk
    bufs = _Buffers(workspace, tc, lc, topk, device)
    block = min(SELECT_BLOCK, triton.next_power_of_2(topk + lc))  # candidates per step of the select passes
    out = torch.empty((num_tokens, topk), dtype=torch.int64, device=device) if out is None else out
    for t0 in range(0, num_tokens, tc):
        t1 = min(num_tokens, t0 + tc)
        n = t1 - t0
        vals = bufs.vals[: n * topk].view(n, topk).fill_(float("-inf"))
        idx = out[t0:t1].fill_(-1)
        for c0 in range(0, length, lc):
            c1 = min(length, c0 + lc)
            scores = score_chunk(t0, t1, c0, c1, bufs.scores)
            _select_topk_kernel[(n,)](vals, idx, scores, bufs.sel, topk, c1 - c0, c0, vals.stride(0), idx.stride(0),
                                      scores.stride(0), KP=padded_topk(topk), BLOCK=block, num_warps=8)  # fmt: skip
    return out


def dsa_indexer_triton(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    k_pool: torch.Tensor,
    k_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    topk: int,
    block_n: int = 64,
    budget_bytes: int = DEFAULT_SCRATCH_BUDGET,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_idx [T, Hi, Di], weights [T, Hi], k_pool [NB, BS, Di] (fp32 / bf16 / fp16, or uint8 fp8 rows [NB, BS,
    Di+1]), k_new [T, Di] fp32, cu_seqlens [N+1], block_tables [N, B], positions [T] -> indices [T, topk] int64
    (written into `out` when given). Candidates: positions 0..B*BS-1 (the tables' capacity); scores in chunks
    (`chunked_topk`), no host synchronization; `workspace` (uint8, `sizes.workspace_bytes`) holds every chunk buffer."""
    pool = k_pool.contiguous()
    table = pool_table([pool])
    check_pool_offsets(table, 0, block_tables=block_tables.cpu().numpy())
    return dsa_indexer_launch(q_idx, weights, torch.from_numpy(table).to(q_idx.device), 0, pool.shape[1], pool.dtype,
                              k_new, cu_seqlens, block_tables, positions, topk=topk, block_n=block_n,
                              budget_bytes=budget_bytes, out=out, workspace=workspace)  # fmt: skip


def dsa_indexer_launch(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    pool_table: torch.Tensor,
    pool_index: int,
    block_size: int,
    pool_dtype: torch.dtype,
    k_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    topk: int,
    block_n: int = 64,
    budget_bytes: int = DEFAULT_SCRATCH_BUDGET,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dsa_indexer_triton` with the key pool [NB, block_size, W] of `pool_dtype` as row `pool_index` of
    `pool_table`. Nothing is checked on the host (the TensorRT plugin's path); whoever builds the table checks it."""
    q, w, new, cu, tables, pos = indexer_inputs(q_idx, weights, k_new, cu_seqlens, block_tables, positions, topk)
    num_tokens, num_heads, dim = q.shape
    seqs = token_sequences(cu, num_tokens).contiguous()
    length = tables.shape[1] * block_size
    chunk = chunk_shape(num_tokens, length, topk, budget_bytes, block_n)
    block_n, stages = score_tiles(pool_dtype, block_size, block_n)
    meta = dict(DI=dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
                BLOCK_N=block_n, POOL_FP8=pool_dtype == torch.uint8, POOL_DTYPE=TRITON_DTYPES[pool_dtype],
                DOT_BF16=pool_dtype in (torch.bfloat16, torch.uint8), UPCAST=INTERPRETED, ONE_BLOCK=block_size % block_n == 0,
                num_warps=SCORE_WARPS, num_stages=stages)  # fmt: skip

    def score_chunk(t0: int, t1: int, c0: int, c1: int, buffer: torch.Tensor) -> torch.Tensor:
        view = buffer[: (t1 - t0) * (c1 - c0)].view(t1 - t0, c1 - c0)
        steps = blocks_per_program(t1 - t0, c1 - c0, block_n)
        _index_scores_kernel[(t1 - t0, triton.cdiv(c1 - c0, steps * block_n))](
            q, w, pool_table, new, seqs, cu, tables, pos, view,
            pool_index, num_heads, c1 - c0, block_size, tables.shape[1], t0, c0, steps,
            q.stride(0), q.stride(1), w.stride(0), view.stride(0), **meta,
        )  # fmt: skip
        return view

    return chunked_topk(score_chunk, num_tokens, length, topk, chunk, q.device, out=out, workspace=workspace)

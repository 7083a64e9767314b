"""Triton DSAIndexer (semantics in `reference.py`).

A Triton kernel writes the index scores [T, Lmax] (one program per token and BLOCK_N cache positions: the
token's [Hi, Di] queries against a [BLOCK_N, Di] key tile, relu, head-weighted sum; positions beyond the
token get -inf and blocks wholly beyond it skip the loads; keys of earlier steps are loaded from the paged pool
(reached through the pool table, `plugins/pool_table.py`) through the sequence's block table, the step's own from `k_new`, and cast (fp8 pools: decoded) to fp32 after the
load), then the top-k is taken with the op's tie rule (`cpu.select_topk`'s: best first, ties to the lower position).
Dot products use `input_precision="ieee"` (fp32). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

`dsa_indexer_triton` bounds its memory and never synchronizes with the host: the candidate positions span the
block table's capacity (B * BS, from shapes; not max(positions), which would be read back), and scores are made
and reduced in chunks of tokens x positions (`chunked_topk`: a running top-k merged chunk by chunk, ties to the
lower position as in `select_topk`), so scratch stays near `budget_bytes` (`sizes.scratch_bytes`) at any context
length instead of [T, max_pos + 1] fp32 plus a full sort (64 GiB at T = 16,384 and 1M positions).
"""

import torch
import triton
import triton.language as tl

from ..pool_table import TRITON_DTYPES, check_pool_offsets, in_pool, pool_entry, pool_table
from ..sparse_mla_attention.reference import token_sequences
from ..sparse_mla_attention.triton_kernel import fp8_rows_to_f32
from .sizes import DEFAULT_SCRATCH_BUDGET, chunk_shape


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, pool_table_ptr, new_ptr, seq_ptr, cu_ptr, tables_ptr, pos_ptr, out_ptr,
    pool_index, num_heads, out_len, block_size, table_width, t0, col0,
    stride_qt, stride_qh, stride_wt, stride_ot,
    DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    POOL_FP8: tl.constexpr, POOL_DTYPE: tl.constexpr,
):
    """Scores of tokens t0.. against positions col0..; the key pool [NB, block_size, DI (+1 if POOL_FP8)] of
    POOL_DTYPE is row `pool_index` of the pool table (NB its capacity: block ids are clamped into it; an invalid
    row reads no pool memory)."""
    pool_ptr, num_blocks, pool_ok = pool_entry(pool_table_ptr, pool_index, POOL_DTYPE)
    t = t0 + tl.program_id(0)  # token; the output row is program_id(0), positions col0 + column
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = col0 + offs_c
    pos = tl.load(pos_ptr + t)
    valid = offs_n <= pos
    score = tl.zeros([BLOCK_N], tl.float32)
    if col0 + tl.program_id(1) * BLOCK_N <= pos:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < num_heads
        mask_d = offs_d < DI
        q = tl.load(
            q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :], other=0.0,
        )  # fmt: skip
        w = tl.load(w_ptr + t * stride_wt + offs_h, mask=mask_h, other=0.0)
        seq = tl.load(seq_ptr + t)
        first = tl.load(cu_ptr + seq)
        chunk_start = tl.load(pos_ptr + first)
        own = valid & (offs_n >= chunk_start)
        past = valid & (offs_n < chunk_start)
        block = tl.load(tables_ptr + seq * table_width + offs_n // block_size, mask=past, other=0).to(tl.int64)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
        past = in_pool(past, pool_ok)
        pool_row = pool_ptr + (block * block_size + offs_n % block_size) * (DI + POOL_FP8)  # [BLOCK_N]
        new_rows = new_ptr + (first + offs_n - chunk_start)[:, None] * DI
        k = tl.load(pool_row[:, None] + offs_d[None, :], mask=past[:, None] & mask_d[None, :], other=0)
        if POOL_FP8:
            k = fp8_rows_to_f32(k, tl.load(pool_row + DI, mask=past, other=127))
        else:
            k = k.to(tl.float32)
        k += tl.load(new_rows + offs_d[None, :], mask=own[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)  # [BLOCK_H, BLOCK_N]
        score = tl.sum(s * w[:, None], axis=0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + tl.program_id(0) * stride_ot + offs_c, score, mask=offs_c < out_len)


class _Buffers:
    """The chunk buffers, carved from a uint8 workspace (or allocated when none is given)."""

    def __init__(self, workspace: torch.Tensor | None, tc: int, lc: int, topk: int, device):
        sizes = {"scores": (4, tc * lc), "vals": (4, tc * topk), "idx": (8, tc * topk), "cat_v": (4, tc * (topk + lc)),
                 "cat_i": (8, tc * (topk + lc)), "sort_v": (4, tc * (topk + lc)), "sort_o": (8, tc * (topk + lc)),
                 "cols": (8, lc)}  # fmt: skip
        dtypes = {4: torch.float32, 8: torch.int64}
        offset = 0
        for name, (width, count) in sizes.items():
            if workspace is None:
                buf = torch.empty(count, dtype=dtypes[width], device=device)
            else:
                if workspace.numel() < offset + width * count:
                    raise ValueError(f"DSAIndexer workspace of {workspace.numel()} bytes is too small")
                buf = workspace[offset : offset + width * count].view(dtypes[width])
                offset += -(-(width * count) // 256) * 256
            setattr(self, name, buf)


def chunked_topk(score_chunk, num_tokens: int, length: int, topk: int, chunk: tuple[int, int], device,
                 out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[T, topk] int64 best positions (-1 where fewer candidates) over positions 0..length-1, the scores made
    by `score_chunk(t0, t1, c0, c1, buffer)` -> [t1-t0, c1-c0] fp32 (-inf = not a candidate; `buffer` is a flat
    fp32 buffer it may write them into), chunk by chunk: a running top-k merged with each chunk by one stable
    descending sort (the running best holds the lower positions, so ties go to the lower position). Every
    buffer comes from `workspace` when given."""
    tc, lc = chunk
    bufs = _Buffers(workspace, tc, lc, topk, device)
    out = torch.empty((num_tokens, topk), dtype=torch.int64, device=device) if out is None else out
    for t0 in range(0, num_tokens, tc):
        t1 = min(num_tokens, t0 + tc)
        n = t1 - t0
        vals = bufs.vals[: n * topk].view(n, topk).fill_(float("-inf"))
        idx = bufs.idx[: n * topk].view(n, topk).fill_(-1)
        for c0 in range(0, length, lc):
            c1 = min(length, c0 + lc)
            width = topk + c1 - c0
            scores = score_chunk(t0, t1, c0, c1, bufs.scores)
            cols = torch.arange(c0, c1, device=device, out=bufs.cols[: c1 - c0])
            cat_v = bufs.cat_v[: n * width].view(n, width)
            cat_i = bufs.cat_i[: n * width].view(n, width)
            torch.cat([vals, scores], dim=1, out=cat_v)
            torch.cat([idx, cols.expand(n, c1 - c0)], dim=1, out=cat_i)
            sort_v = bufs.sort_v[: n * width].view(n, width)
            sort_o = bufs.sort_o[: n * width].view(n, width)
            torch.sort(cat_v, dim=1, descending=True, stable=True, out=(sort_v, sort_o))
            vals.copy_(sort_v[:, :topk])
            torch.gather(cat_i, 1, sort_o[:, :topk], out=idx)
        out[t0:t1].copy_(idx).masked_fill_(torch.isneginf(vals), -1)
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
    num_tokens, num_heads, dim = q_idx.shape
    q = q_idx.float().contiguous()
    w = weights.float().contiguous()
    new = k_new.float().contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    seqs = token_sequences(cu, num_tokens).contiguous()
    pos = positions.to(torch.int64).contiguous()
    length = tables.shape[1] * block_size
    chunk = chunk_shape(num_tokens, length, topk, budget_bytes, block_n)
    meta = dict(DI=dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
                BLOCK_N=block_n, POOL_FP8=pool_dtype == torch.uint8, POOL_DTYPE=TRITON_DTYPES[pool_dtype])  # fmt: skip

    def score_chunk(t0: int, t1: int, c0: int, c1: int, buffer: torch.Tensor) -> torch.Tensor:
        view = buffer[: (t1 - t0) * (c1 - c0)].view(t1 - t0, c1 - c0)
        _index_scores_kernel[(t1 - t0, triton.cdiv(c1 - c0, block_n))](
            q, w, pool_table, new, seqs, cu, tables, pos, view,
            pool_index, num_heads, c1 - c0, block_size, tables.shape[1], t0, c0,
            q.stride(0), q.stride(1), w.stride(0), view.stride(0), **meta,
        )  # fmt: skip
        return view

    return chunked_topk(score_chunk, num_tokens, length, topk, chunk, q.device, out=out, workspace=workspace)

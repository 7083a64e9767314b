"""Triton DSAIndexer (semantics in `reference.py`).

A Triton kernel writes the index scores [T, Lmax] (one program per token and BLOCK_N cache positions: the
token's [Hi, Di] queries against a [BLOCK_N, Di] key tile, relu, head-weighted sum; positions beyond the
token get -inf and blocks wholly beyond it skip the loads; keys of earlier steps are loaded from the paged pool
through the sequence's block table, the step's own from `k_new`, and cast (fp8 pools: decoded) to fp32 after the
load), then `cpu.select_topk` (torch, runs on the same device) takes the top-k with the op's tie rule.
Lmax = max(positions) + 1. Dot products use `input_precision="ieee"` (fp32). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from ..sparse_mla_attention.reference import token_sequences
from ..sparse_mla_attention.triton_kernel import fp8_rows_to_f32
from .cpu import select_topk


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, pool_ptr, new_ptr, seq_ptr, cu_ptr, tables_ptr, pos_ptr, out_ptr,
    num_heads, out_len, block_size, table_width,
    stride_qt, stride_qh, stride_wt, stride_ot,
    DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    POOL_FP8: tl.constexpr = False,
):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(pos_ptr + t)
    valid = offs_n <= pos
    score = tl.zeros([BLOCK_N], tl.float32)
    if tl.program_id(1) * BLOCK_N <= pos:
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
        block = tl.load(tables_ptr + seq * table_width + offs_n // block_size, mask=past, other=0)
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
    tl.store(out_ptr + t * stride_ot + offs_n, score, mask=offs_n < out_len)


def dsa_index_scores_triton(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    k_pool: torch.Tensor,
    k_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_n: int = 64,
) -> torch.Tensor:
    """Index scores [T, max(positions)+1] fp32 (-inf beyond each token's position)."""
    num_tokens, num_heads, dim = q_idx.shape
    q = q_idx.float().contiguous()
    w = weights.float().contiguous()
    pool = k_pool.contiguous()
    new = k_new.float().contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    seqs = token_sequences(cu, num_tokens).contiguous()
    pos = positions.to(torch.int64).contiguous()
    out_len = int(pos.max()) + 1 if num_tokens else 0
    out = torch.empty(num_tokens, out_len, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(out_len, block_n))
    _index_scores_kernel[grid](
        q, w, pool, new, seqs, cu, tables, pos, out,
        num_heads, out_len, pool.shape[1], tables.shape[1],
        q.stride(0), q.stride(1), w.stride(0), out.stride(0),
        DI=dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n, POOL_FP8=pool.dtype == torch.uint8,
    )  # fmt: skip
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
) -> torch.Tensor:
    """q_idx [T, Hi, Di], weights [T, Hi], k_pool [NB, BS, Di] (fp32 / bf16 / fp16, or uint8 fp8 rows [NB, BS,
    Di+1]), k_new [T, Di] fp32,
    cu_seqlens [N+1], block_tables [N, B], positions [T] -> indices [T, topk] int64."""
    scores = dsa_index_scores_triton(q_idx, weights, k_pool, k_new, cu_seqlens, block_tables, positions, block_n=block_n)
    return select_topk(scores, topk)

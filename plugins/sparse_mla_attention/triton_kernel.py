"""Triton SparseMLAAttention (semantics in `reference.py`).

One program per (query token, block of BLOCK_H heads). It walks the token's K indices (or, dense, positions
0..pos) in blocks of BLOCK_K, gathers those latent rows from the slot's cache, and keeps an online softmax
(running max / sum) with an fp32 accumulator [BLOCK_H, Dc]. Dot products use `input_precision="ieee"` so fp32
inputs give fp32 results (TF32 would lose ~1e-3). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from .reference import token_slots


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, slot_ptr, pos_ptr, o_ptr,
    num_heads, num_idx, scale,
    stride_qt, stride_qh, stride_ks, stride_kl, stride_it, stride_ot, stride_oh,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < num_heads
    mask_c = offs_c < DC
    mask_r = offs_r < DR

    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + DC + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t)
    kv_base = kv_ptr + slot * stride_ks

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    if HAS_INDICES:
        n_iter = num_idx
    else:
        n_iter = pos + 1
    for start in range(0, n_iter, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        if HAS_INDICES:
            idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=offs_k < num_idx, other=-1)
        else:
            idx = offs_k.to(tl.int64)
        valid = (idx >= 0) & (idx <= pos)
        rows = kv_base + idx[:, None] * stride_kl
        k_c = tl.load(rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        k_r = tl.load(rows + DC + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
        s += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k_c, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh
    tl.store(o_rows + offs_c[None, :], out, mask=mask_h[:, None] & mask_c[None, :])


def sparse_mla_attention_triton(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    topk_indices: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
    block_h: int = 16,
    block_k: int = 32,
) -> torch.Tensor:
    """q_lat [T, H, Dc+Dr] fp32, kv_cache [S, L, Dc+Dr] fp32, cu_seqlens [N+1], slot_ids [N], positions [T],
    topk_indices [T, K] int64 or None (None or K = 0: dense causal) -> o_lat [T, H, Dc] fp32."""
    num_tokens, num_heads, dim = q_lat.shape
    q = q_lat.float().contiguous()
    kv = kv_cache.float().contiguous()
    slots = token_slots(cu_seqlens, slot_ids, num_tokens).contiguous()
    pos = positions.to(torch.int64).contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    has_indices = topk_indices is not None and topk_indices.shape[1] > 0
    idx = topk_indices.to(torch.int64).contiguous() if has_indices else pos.view(num_tokens, 1)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _sparse_mla_kernel[grid](
        q, kv, idx, slots, pos, out,
        num_heads, idx.shape[1], float(scale),
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), idx.stride(0), out.stride(0), out.stride(1),
        DC=kv_lora_rank, DR=dim - kv_lora_rank,
        BLOCK_DC=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_DR=max(16, triton.next_power_of_2(dim - kv_lora_rank)),
        BLOCK_H=block_h, BLOCK_K=block_k, HAS_INDICES=has_indices,
    )
    return out

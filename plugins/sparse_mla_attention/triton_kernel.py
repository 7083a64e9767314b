"""Triton SparseMLAAttention (semantics in `reference.py`).

One program per (query token, block of BLOCK_H heads). It finds its token's sequence by counting the
`cu_seqlens` ends at or before the token (`reference.token_slots`, done in the kernel so that a TensorRT launch
needs nothing computed on the host), then walks the token's K indices (or, when there are none, positions
0..pos) in blocks of BLOCK_K, gathers those latent rows from the slot's cache, and keeps an online softmax
(running max / sum) with an fp32 accumulator [BLOCK_H, Dc]. Dense vs sparse is decided at run time
(`num_idx == 0` is dense), so one compiled kernel serves both. Dot products use `input_precision="ieee"` so
fp32 inputs give fp32 results (TF32 would lose ~1e-3). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

All tensors are contiguous. Kernel parameters are the six input pointers, the int32 scalars, then the output
pointer, then compile-time constants: the order a TensorRT AOT plugin launch uses (`tensorrt_plugin`).
"""

import torch
import triton
import triton.language as tl

_SEQ_BLOCK = tl.constexpr(64)  # cu_seqlens entries compared per step of the token -> sequence search


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, cu_seqlens_ptr, slot_ids_ptr, pos_ptr, idx_ptr,
    num_seqs, num_slots, cache_len, num_idx,
    o_ptr,
    scale: tl.constexpr, H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """q [T, H, DC+DR], kv [S, cache_len, DC+DR], cu_seqlens [num_seqs+1], slot_ids [num_seqs], pos [T],
    idx [T, num_idx] (num_idx = 0: dense causal; idx is then not read) -> o [T, H, DC] fp32. The sequence,
    slot and position are clamped into [0, num_seqs-1], [0, num_slots-1], [0, cache_len-1]: TensorRT times
    tactics on unspecified input contents, which must not send the kernel outside its buffers."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    mask_c = offs_c < DC
    mask_r = offs_r < DR

    # sequence of token t = number of sequences ending at or before t (searchsorted(cu[1:], t, right=True))
    seq = tl.zeros([], tl.int64)
    for start in range(0, num_seqs, _SEQ_BLOCK):
        offs_n = start + tl.arange(0, _SEQ_BLOCK)
        ends = tl.load(cu_seqlens_ptr + 1 + offs_n, mask=offs_n < num_seqs, other=0)
        seq += tl.sum(((offs_n < num_seqs) & (ends <= t)).to(tl.int64), axis=0)
    seq = tl.minimum(seq, num_seqs - 1)
    slot = tl.minimum(tl.maximum(tl.load(slot_ids_ptr + seq).to(tl.int64), 0), num_slots - 1)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), cache_len - 1)

    q_row = q_ptr + (t * H + offs_h[:, None]) * (DC + DR)
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + DC + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    kv_base = kv_ptr + slot * cache_len * (DC + DR)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    sparse = num_idx > 0
    n_iter = tl.where(sparse, num_idx, pos + 1)
    for start in range(0, n_iter, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K).to(tl.int64)
        idx = tl.load(idx_ptr + t * num_idx + offs_k, mask=offs_k < num_idx, other=-1)
        idx = tl.where(sparse, idx, offs_k)
        valid = (idx >= 0) & (idx <= pos)
        rows = kv_base + idx[:, None] * (DC + DR)
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
    o_rows = o_ptr + (t * H + offs_h[:, None]) * DC
    tl.store(o_rows + offs_c[None, :], out, mask=mask_h[:, None] & mask_c[None, :])


def block_sizes(kv_lora_rank: int, rope_dim: int) -> tuple[int, int]:
    """(BLOCK_DC, BLOCK_DR): the latent and rope widths rounded up to powers of two (at least 16, for tl.dot)."""
    return max(16, triton.next_power_of_2(kv_lora_rank)), max(16, triton.next_power_of_2(rope_dim))


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
    cu = cu_seqlens.to(torch.int64).contiguous()
    slots = slot_ids.to(torch.int64).contiguous()
    pos = positions.to(torch.int64).contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    has_indices = topk_indices is not None and topk_indices.shape[1] > 0
    idx = topk_indices.to(torch.int64).contiguous() if has_indices else pos  # dense: idx is never read
    if num_tokens == 0 or slots.numel() == 0 or kv.shape[0] == 0 or kv.shape[1] == 0:
        return out.zero_()
    block_dc, block_dr = block_sizes(kv_lora_rank, dim - kv_lora_rank)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _sparse_mla_kernel[grid](
        q, kv, cu, slots, pos, idx,
        slots.numel(), kv.shape[0], kv.shape[1], idx.shape[1] if has_indices else 0,
        out,
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=dim - kv_lora_rank,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k, enable_fp_fusion=True,
    )  # fmt: skip
    return out


def aot_compile(
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    scale: float,
    capability: int,
    block_h: int = 16,
    block_k: int = 32,
):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU); fp32 q, cache and output.

    Returns Triton's CompiledKernel: ``asm["ptx"]``, ``metadata.name``, ``metadata.num_warps``,
    ``metadata.shared``. Parameters: q_lat, kv_cache, cu_seqlens, slot_ids, positions, topk_indices pointers;
    int32 num_seqs (N), num_slots (S), cache_len (L), num_idx (K, 0 = dense); o_lat pointer. Grid (T, cdiv(H, block_h)).
    """
    from triton.backends.compiler import GPUTarget

    block_dc, block_dr = block_sizes(kv_lora_rank, rope_dim)
    signature = dict(
        q_ptr="*fp32", kv_ptr="*fp32", cu_seqlens_ptr="*i64", slot_ids_ptr="*i64", pos_ptr="*i64",
        idx_ptr="*i64", num_seqs="i32", num_slots="i32", cache_len="i32", num_idx="i32", o_ptr="*fp32",
    )  # fmt: skip
    constexprs = dict(
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=rope_dim,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k,
    )  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=_sparse_mla_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(enable_fp_fusion=True))

"""Triton SparseMLAAttention (semantics in `reference.py`).

One program per (query token, block of BLOCK_H heads). It finds its token's sequence by counting the
`cu_seqlens` ends at or before the token (`reference.token_sequences`, done in the kernel so that a TensorRT
launch needs nothing computed on the host), then walks the token's K indices (or, when there are none, positions
0..pos) in blocks of BLOCK_K, loads those latent rows (the step's own positions from `kv_new`, earlier ones from
the paged pool, reached through the pool table (`plugins/pool_table.py`), through the sequence's block table, cast to fp32 after the load; fp8 pools decoded by
`fp8_rows_to_f32`), and keeps an online softmax
(running max / sum) with an fp32 accumulator [BLOCK_H, Dc]. Dense vs sparse is decided at run time
(`num_idx == 0` is dense), so one compiled kernel serves both. Dot products use `input_precision="ieee"` so
fp32 inputs give fp32 results (TF32 would lose ~1e-3). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

All tensors are contiguous. Kernel parameters are the seven input pointers, the int32 scalars, then the output
pointer, then compile-time constants: the order a TensorRT AOT plugin launch uses (`tensorrt_plugin`).
Every index read from an input (sequence, first token, position, block id, new-row index) is clamped into its
buffer: TensorRT runs plugins while timing tactics with unspecified input contents.
"""

import torch
import triton
import triton.language as tl

from ..pool_table import TRITON_DTYPES, check_pool_offsets, in_pool, pool_entry, pool_table
from .sizes import block_sizes

_SEQ_BLOCK = tl.constexpr(64)  # cu_seqlens entries compared per step of the token -> sequence search


@triton.jit
def token_sequence(cu_seqlens_ptr, num_seqs, t):
    """Sequence of packed token t (int64 scalar): the number of sequences ending at or before t
    (`reference.token_sequences`, searchsorted(cu[1:], t, right=True)), clamped to num_seqs - 1."""
    seq = tl.zeros([], tl.int64)
    for start in range(0, num_seqs, _SEQ_BLOCK):
        offs_n = start + tl.arange(0, _SEQ_BLOCK)
        ends = tl.load(cu_seqlens_ptr + 1 + offs_n, mask=offs_n < num_seqs, other=0)
        seq += tl.sum(((offs_n < num_seqs) & (ends <= t)).to(tl.int64), axis=0)
    return tl.minimum(seq, num_seqs - 1)


@triton.jit
def fp8_rows_to_f32(codes, scale_bytes):
    """fp8 cache rows -> fp32: E4M3 codes [R, C] (uint8) x 2^(scale byte - 127) per row (scale_bytes [R] uint8),
    by bit arithmetic (`moe_export.quantize.fp8_cache`); NaN codes (0x7F, 0xFF) and scale byte 255 give NaN."""
    b = codes.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)  # (1 + m/8) 2^(e-7)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
    value = tl.where(b >= 128, -magnitude, magnitude)
    value = tl.where((b & 0x7F) == 0x7F, float("nan"), value)
    s = scale_bytes.to(tl.int32)
    scale = tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))  # 2^(s-127); 2^-127
    scale = tl.where(s == 255, float("nan"), scale)
    return value * scale[:, None]


@triton.jit
def _sparse_mla_kernel(
    q_ptr, pool_table_ptr, new_ptr, cu_seqlens_ptr, block_tables_ptr, pos_ptr, idx_ptr,
    pool_index, num_seqs, num_tokens, block_size, table_width, num_idx,
    o_ptr,
    scale: tl.constexpr, H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    POOL_FP8: tl.constexpr, POOL_DTYPE: tl.constexpr,
):
    """q [T, H, DC+DR]; the pool [NB, block_size, DC+DR] of POOL_DTYPE (POOL_FP8: uint8 [NB, block_size,
    DC+DR+1]) is row `pool_index` of the pool table (NB its capacity; an invalid row: no pool row is read);
    new [T, DC+DR], cu_seqlens [num_seqs+1], block_tables [num_seqs, table_width], pos [T], idx [T, num_idx]
    (num_idx = 0: dense causal; idx is then not read) -> o [T, H, DC] fp32."""
    t = tl.program_id(0).to(tl.int64)
    pool_ptr, num_blocks, pool_ok = pool_entry(pool_table_ptr, pool_index, POOL_DTYPE)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    mask_c = offs_c < DC
    mask_r = offs_r < DR

    seq = token_sequence(cu_seqlens_ptr, num_seqs, t)
    first = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # the sequence's first token in this step
    first = tl.minimum(tl.maximum(first, 0), t)
    chunk_start = tl.maximum(tl.load(pos_ptr + first).to(tl.int64), 0)  # earlier positions are in the pool
    max_pos = table_width.to(tl.int64) * block_size - 1  # the last position the block table can address
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos)
    table = block_tables_ptr + seq * table_width

    q_row = q_ptr + (t * H + offs_h[:, None]) * (DC + DR)
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_row + DC + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

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
        own = valid & (idx >= chunk_start) & (first + idx - chunk_start < num_tokens)
        past = valid & (idx < chunk_start)
        block = tl.load(table + idx // block_size, mask=past, other=0).to(tl.int64)
        past = in_pool(past, pool_ok)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
        pool_row = pool_ptr + (block * block_size + idx % block_size) * (DC + DR + POOL_FP8)  # [BLOCK_K]
        pool_rows = pool_row[:, None]
        new_rows = new_ptr + (first + idx - chunk_start)[:, None] * (DC + DR)
        k_c = tl.load(pool_rows + offs_c[None, :], mask=past[:, None] & mask_c[None, :], other=0)
        k_r = tl.load(pool_rows + DC + offs_r[None, :], mask=past[:, None] & mask_r[None, :], other=0)
        if POOL_FP8:
            scale_bytes = tl.load(pool_row + DC + DR, mask=past, other=127)
            k_c = fp8_rows_to_f32(k_c, scale_bytes)
            k_r = fp8_rows_to_f32(k_r, scale_bytes)
        else:
            k_c = k_c.to(tl.float32)
            k_r = k_r.to(tl.float32)
        k_c += tl.load(new_rows + offs_c[None, :], mask=own[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        k_r += tl.load(new_rows + DC + offs_r[None, :], mask=own[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
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


def sparse_mla_attention_triton(
    q_lat: torch.Tensor,
    kv_pool: torch.Tensor,
    kv_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk_indices: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
    block_h: int = 16,
    block_k: int = 32,
) -> torch.Tensor:
    """q_lat [T, H, Dc+Dr] fp32, kv_pool [NB, BS, Dc+Dr] (fp32 / bf16 / fp16, or uint8 fp8 rows [NB, BS, Dc+Dr+1]),
    kv_new [T, Dc+Dr] fp32,
    cu_seqlens [N+1], block_tables [N, B], positions [T], topk_indices [T, K] int64 or None (None or K = 0:
    dense causal) -> o_lat [T, H, Dc] fp32."""
    num_tokens, num_heads, dim = q_lat.shape
    q = q_lat.float().contiguous()
    pool = kv_pool.contiguous()
    new = kv_new.float().contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    pos = positions.to(torch.int64).contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    has_indices = topk_indices is not None and topk_indices.shape[1] > 0
    idx = topk_indices.to(torch.int64).contiguous() if has_indices else pos  # dense: idx is never read
    if num_tokens == 0 or cu.numel() < 2 or pool.shape[0] == 0 or tables.shape[1] == 0:
        return out.zero_()
    table = pool_table([pool])
    check_pool_offsets(table, 0, block_tables=tables.cpu().numpy())
    sparse_mla_attention_launch(q, torch.from_numpy(table).to(q.device), 0, pool.shape[1], pool.dtype, new, cu, tables,
                                pos, idx if has_indices else None, out, scale=scale, kv_lora_rank=kv_lora_rank,
                                block_h=block_h, block_k=block_k)  # fmt: skip
    return out


def sparse_mla_attention_launch(q, pool_table, pool_index, block_size, pool_dtype, new, cu, tables, pos, idx, out, *,
                                scale: float, kv_lora_rank: int, block_h: int = 16, block_k: int = 32) -> None:
    """The kernel over contiguous fp32 q [T, H, Dc+Dr] / new [T, Dc+Dr], int64 cu / tables / pos / idx (None:
    dense) into out [T, H, Dc]; the pool [NB, block_size, W] of `pool_dtype` is row `pool_index` of `pool_table`.
    Nothing is checked on the host (the TensorRT plugin's path); whoever builds the table checks it."""
    num_tokens, num_heads, dim = q.shape
    if num_tokens == 0 or cu.numel() < 2 or tables.shape[1] == 0:
        out.zero_()
        return
    block_dc, block_dr = block_sizes(kv_lora_rank, dim - kv_lora_rank)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _sparse_mla_kernel[grid](
        q, pool_table, new, cu, tables, pos, pos if idx is None else idx,
        pool_index, cu.numel() - 1, num_tokens, block_size, tables.shape[1], 0 if idx is None else idx.shape[1],
        out,
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=dim - kv_lora_rank,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k, POOL_FP8=pool_dtype == torch.uint8,
        POOL_DTYPE=TRITON_DTYPES[pool_dtype], enable_fp_fusion=True,
    )  # fmt: skip


def aot_compile(
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    scale: float,
    capability: int,
    block_h: int = 16,
    block_k: int = 32,
    pool_dtype: torch.dtype = torch.float32,
):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU); fp32 q, new rows and
    output, the pool in `pool_dtype` (fp32, bf16, fp16, or uint8: fp8 rows with their scale byte).

    Returns Triton's CompiledKernel: ``asm["ptx"]``, ``metadata.name``, ``metadata.num_warps``,
    ``metadata.shared``. Parameters: q_lat, pool table, kv_new, cu_seqlens, block_tables, positions,
    topk_indices pointers; int32 pool_index, num_seqs (N), num_tokens (T), block_size (BS), table_width (B),
    num_idx (K, 0 = dense); o_lat pointer.
    Grid (T, cdiv(H, block_h)).
    """
    from triton.backends.compiler import GPUTarget

    block_dc, block_dr = block_sizes(kv_lora_rank, rope_dim)
    signature = dict(
        q_ptr="*fp32", pool_table_ptr="*i64", new_ptr="*fp32", cu_seqlens_ptr="*i64", block_tables_ptr="*i64",
        pos_ptr="*i64", idx_ptr="*i64", pool_index="i32", num_seqs="i32", num_tokens="i32", block_size="i32",
        table_width="i32", num_idx="i32",
        o_ptr="*fp32",
    )  # fmt: skip
    constexprs = dict(
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=rope_dim,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k, POOL_FP8=pool_dtype == torch.uint8,
        POOL_DTYPE=TRITON_DTYPES[pool_dtype],
    )  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=_sparse_mla_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(enable_fp_fusion=True))

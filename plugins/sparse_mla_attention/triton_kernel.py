"""Triton SparseMLAAttention (semantics in `reference.py`), flash-decoding style.

One program per (query token, block of BLOCK_H heads: all K3 heads of a tp-8 rank, 12, in one tile, so each
latent row is read once per program, split of the token's keys). It finds its token's sequence by counting the
`cu_seqlens` ends at or before the token (`reference.token_sequences`, in the kernel so that a TensorRT launch
needs nothing computed on the host), then walks its share of the token's K indices (or, when there are none,
positions 0..pos: the dense path, split the same way) in blocks of BLOCK_K, loads those latent rows (the step's
own positions from `kv_new`, earlier ones from the paged pool, reached through the pool table
(`plugins/pool_table.py`) and the sequence's block table; fp8 pools decoded by `fp8_rows_to_f32`), and keeps an
online softmax (running max / sum) with an fp32 accumulator [BLOCK_H, Dc]. Decode has few tokens, so the keys are
split across programs (`sizes.num_splits`: two programs per SM) and `_combine_splits_kernel` merges the partial
softmaxes by their log-sum-exp; prefill runs one split, which writes the output itself. Dense vs sparse is
decided at run time (`num_idx == 0` is dense), so one compiled kernel serves both. Dots: bf16 and fp8 pools give
bf16 operands to the tensor cores (q and the softmax weights rounded to bf16) with fp32 accumulation; fp32 and
fp16 pools exact fp32 dots (`input_precision="ieee"`). Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

All tensors are contiguous. Kernel parameters are the seven input pointers, the int32 scalars, then the output
pointer (then the split partials' pointers, constants None in the one-split AOT build), then compile-time
constants: the order a TensorRT AOT plugin launch uses (`tensorrt_plugin`).
Every index read from an input (sequence, first token, position, block id, new-row index) is clamped into its
buffer: TensorRT runs plugins while timing tactics with unspecified input contents.
"""

import torch
import triton
import triton.language as tl

from ..aot_contract import aot_compile_options
from ..pool_table import TRITON_DTYPES, check_pool_offsets, in_pool, pool_entry, pool_table
from ..triton_dot import INTERPRETED, mma
from .inputs import attention_inputs
from .sizes import block_sizes, num_splits

_SEQ_BLOCK = tl.constexpr(64)
COMBINE_COLUMNS = 64  # latent columns per combine program  # cu_seqlens entries compared per step of the token -> sequence search


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
def fp8_codes(codes, DTYPE: tl.constexpr):
    """E4M3 codes (uint8, any shape) -> their values in DTYPE (bf16 or fp32: exact) by the hardware conversion;
    NaN codes (0x7F, 0xFF) give NaN (set explicitly: Triton's interpreter decodes them as +-480)."""
    value = codes.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    return tl.where((codes & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e8m0_scale(scale_bytes):
    """E8M0 scale bytes (uint8) -> fp32 2^(byte - 127) by bit arithmetic (2^-127 is an fp32 subnormal); 255 gives NaN."""
    s = scale_bytes.to(tl.int32)
    scale = tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))
    return tl.where(s == 255, float("nan"), scale)


@triton.jit
def fp8_rows_to_f32(codes, scale_bytes):
    """fp8 cache rows -> fp32: E4M3 codes [R, C] (uint8) x 2^(scale byte - 127) per row (scale_bytes [R] uint8)
    (`moe_export.quantize.fp8_cache`); NaN codes (0x7F, 0xFF) and scale byte 255 give NaN."""
    return fp8_codes(codes, tl.float32) * e8m0_scale(scale_bytes)[:, None]


@triton.jit
def _key_tile(pool_row, new_row, past, own, offs, mask, K_DTYPE: tl.constexpr, POOL_FP8: tl.constexpr):
    """Columns `offs` of the key rows [BLOCK_K, len(offs)] in K_DTYPE: from the pool (`pool_row` [BLOCK_K]
    pointers, where `past`; fp8 rows as their codes' values, the row scale applied by the caller) or the step's
    own rows (`new_row`, where `own`)."""
    k = tl.load(pool_row[:, None] + offs[None, :], mask=past[:, None] & mask[None, :], other=0)
    k = fp8_codes(k, K_DTYPE) if POOL_FP8 else k.to(K_DTYPE)
    new = tl.load(new_row[:, None] + offs[None, :], mask=own[:, None] & mask[None, :], other=0.0)
    return tl.where(own[:, None], new.to(K_DTYPE), k)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, pool_table_ptr, new_ptr, cu_seqlens_ptr, block_tables_ptr, pos_ptr, idx_ptr,
    pool_index, num_seqs, num_tokens, block_size, table_width, num_idx,
    o_ptr, part_ptr, lse_ptr,
    scale: tl.constexpr, H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    POOL_FP8: tl.constexpr, POOL_DTYPE: tl.constexpr, SPLITS: tl.constexpr, DOT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """q [T, H, DC+DR]; the pool [NB, block_size, DC+DR] of POOL_DTYPE (POOL_FP8: uint8 [NB, block_size,
    DC+DR+1]) is row `pool_index` of the pool table (NB its capacity; an invalid row: no pool row is read);
    new [T, DC+DR] (fp32, or bf16 when DOT_BF16), cu_seqlens [num_seqs+1], block_tables [num_seqs,
    table_width], pos [T], idx [T, num_idx] (num_idx = 0: dense causal; idx is then not read). Program (t, head
    block, split) takes split's share of the token's keys: SPLITS = 1 -> o [T, H, DC] fp32; else its
    normalized partial -> part [T, SPLITS, H, DC] and its log-sum-exp -> lse [T, SPLITS, H] (-inf: no key),
    combined by `_combine_splits_kernel`."""
    t = tl.program_id(0).to(tl.int64)
    pool_ptr, num_blocks, pool_ok = pool_entry(pool_table_ptr, pool_index, POOL_DTYPE)
    pool_ptr = tl.multiple_of(pool_ptr, 16)  # `pool_entry` masks every access unless the address is 16-byte aligned
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h, mask_c, mask_r = offs_h < H, offs_c < DC, offs_r < DR

    seq = token_sequence(cu_seqlens_ptr, num_seqs, t)
    first = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # the sequence's first token in this step
    first = tl.minimum(tl.maximum(first, 0), t)
    chunk_start = tl.maximum(tl.load(pos_ptr + first).to(tl.int64), 0)  # earlier positions are in the pool
    max_pos = table_width.to(tl.int64) * block_size - 1  # the last position the block table can address
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos)
    table = block_tables_ptr + seq * table_width

    k_dtype = tl.bfloat16 if DOT_BF16 else tl.float32  # 16-bit and fp8 pools: bf16 operands, fp32 accumulation
    q_row = q_ptr + (t * H + offs_h[:, None]) * (DC + DR)
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(k_dtype)
    q_r = tl.load(q_row + DC + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(k_dtype)

    m_i, l_i = tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32)  # running max, sum
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    sparse = num_idx > 0
    n_iter = tl.where(sparse, num_idx, pos + 1)
    share = tl.cdiv(tl.cdiv(n_iter, SPLITS), BLOCK_K) * BLOCK_K  # keys per split, whole BLOCK_K steps
    split = tl.program_id(2)
    for start in range(split * share, tl.minimum(n_iter, split * share + share), BLOCK_K):
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
        new_row = new_ptr + (first + idx - chunk_start) * (DC + DR)
        k_c = _key_tile(pool_row, new_row, past, own, offs_c, mask_c, k_dtype, POOL_FP8)
        k_r = _key_tile(pool_row + DC, new_row + DC, past, own, offs_r, mask_r, k_dtype, POOL_FP8)
        s = mma(q_r, tl.trans(k_r), mma(q_c, tl.trans(k_c), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), UPCAST), UPCAST)
        if POOL_FP8:  # the rows' E8M0 scales, on the products (their codes went to the tensor cores)
            row_scale = tl.where(own, 1.0, e8m0_scale(tl.load(pool_row + DC + DR, mask=past, other=127)))
            s = s * row_scale[None, :]
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if POOL_FP8:
            p = p * row_scale[None, :]
        acc = mma(p.to(k_dtype), k_c, acc * alpha[:, None], UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask_o = mask_h[:, None] & mask_c[None, :]
    if SPLITS == 1:
        tl.store(o_ptr + (t * H + offs_h[:, None]) * DC + offs_c[None, :], out, mask=mask_o)
    else:
        row = (t * SPLITS + split) * H + offs_h
        tl.store(part_ptr + row[:, None] * DC + offs_c[None, :], out, mask=mask_o)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _combine_splits_kernel(part_ptr, lse_ptr, o_ptr, H: tl.constexpr, DC: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """o[t, heads, columns] = sum_s w_s part[t, s] / sum_s w_s, w_s = exp(lse[t, s] - max_s lse) (0 when no split
    saw a key: o = 0, as the one-split kernel writes); program (t, head block, block of BLOCK_C columns)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_h = offs_h < H
    mask_o = mask_h[:, None] & (offs_c < DC)[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(lse_ptr + (t * SPLITS + s) * H + offs_h, mask=mask_h, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s in range(SPLITS):
        row = (t * SPLITS + s) * H + offs_h
        w = tl.exp(tl.load(lse_ptr + row, mask=mask_h, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * DC + offs_c[None, :], mask=mask_o, other=0.0)
        total += w
    tl.store(o_ptr + (t * H + offs_h[:, None]) * DC + offs_c[None, :], acc / tl.where(total > 0, total, 1.0)[:, None],
             mask=mask_o)  # fmt: skip


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
    block_k: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """q_lat [T, H, Dc+Dr] fp32, kv_pool [NB, BS, Dc+Dr] (fp32 / bf16 / fp16, or uint8 fp8 rows [NB, BS, Dc+Dr+1]),
    kv_new [T, Dc+Dr] fp32,
    cu_seqlens [N+1], block_tables [N, B], positions [T], topk_indices [T, K] int64 or None (None or K = 0:
    dense causal) -> o_lat [T, H, Dc] fp32."""
    q, new, cu, tables, pos, idx = attention_inputs(q_lat, kv_pool, kv_new, cu_seqlens, block_tables, positions,
                                                    topk_indices, kv_lora_rank)
    num_tokens, num_heads, dim = q.shape
    pool = kv_pool.contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or cu.numel() < 2 or pool.shape[0] == 0 or tables.shape[1] == 0:
        return out.zero_()
    table = pool_table([pool])
    check_pool_offsets(table, 0, block_tables=tables.cpu().numpy())
    sparse_mla_attention_launch(q, torch.from_numpy(table).to(q.device), 0, pool.shape[1], pool.dtype, new, cu, tables,
                                pos, idx, out, scale=scale, kv_lora_rank=kv_lora_rank,
                                block_h=block_h, block_k=block_k, splits=splits)  # fmt: skip
    return out


KEY_WARPS = 8


def key_tiles(pool_dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_K, stages) of the key loop as compiled for sm_90 at K3's shapes (8 warps): bf16 rows 32 keys, 2
    deep (asynchronous copies of the gathered rows); fp32 / fp16 rows 32 keys unpipelined (fp32 tiles [32, 576]
    take ~110 KiB of shared memory); fp8 rows (577 bytes, byte loads) 16 keys unpipelined."""
    if pool_dtype == torch.uint8:
        return 16, 1
    return 32, 2 if pool_dtype == torch.bfloat16 else 1


def aot_key_tiles(pool_dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_K, stages) of the AOT form (TensorRT's AOT launch gives 48 KiB of shared memory, no opt-in): bf16
    rows 16 keys unpipelined (36,864 B at K3's widths, 8 warps, no spills); the other pools as `key_tiles`
    (refused: fp32 needs 73,728 B at 16 keys, fp8 53,248 B and spills)."""
    if pool_dtype == torch.bfloat16:
        return 16, 1
    return key_tiles(pool_dtype)


def sparse_mla_attention_launch(q, pool_table, pool_index, block_size, pool_dtype, new, cu, tables, pos, idx, out, *,
                                scale: float, kv_lora_rank: int, block_h: int = 16, block_k: int | None = None,
                                splits: int | None = None) -> None:
    """The kernel over contiguous fp32 q [T, H, Dc+Dr] / new [T, Dc+Dr], int64 cu / tables / pos / idx (None:
    dense) into out [T, H, Dc]; the pool [NB, block_size, W] of `pool_dtype` is row `pool_index` of `pool_table`.
    The keys of a token are split across `splits` programs (default `sizes.num_splits`, from shapes only), whose
    partial softmaxes one more launch combines, in parallel over heads and blocks of latent columns. With bf16
    and fp8 pools the new rows go to the kernel in bf16 (exact: the graph rounds them to the pool's values).
    Nothing is checked on the host (the TensorRT plugin's path); whoever builds the table checks it."""
    num_tokens, num_heads, dim = q.shape
    if num_tokens == 0 or cu.numel() < 2 or tables.shape[1] == 0:
        out.zero_()
        return
    block_dc, block_dr = block_sizes(kv_lora_rank, dim - kv_lora_rank)
    default_k, stages = key_tiles(pool_dtype)
    block_k = block_k or default_k
    dot_bf16 = pool_dtype in (torch.bfloat16, torch.uint8)
    if dot_bf16:
        new = new.to(torch.bfloat16)
    keys = idx.shape[1] if idx is not None else tables.shape[1] * block_size
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = splits or num_splits(num_tokens * head_blocks, keys, block_k)
    part = lse = None
    if splits > 1:
        part = torch.empty(num_tokens, splits, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, splits, num_heads, dtype=torch.float32, device=q.device)
    _sparse_mla_kernel[(num_tokens, head_blocks, splits)](
        q, pool_table, new, cu, tables, pos, pos if idx is None else idx,
        pool_index, cu.numel() - 1, num_tokens, block_size, tables.shape[1], 0 if idx is None else idx.shape[1],
        out, part, lse,
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=dim - kv_lora_rank,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k, POOL_FP8=pool_dtype == torch.uint8,
        POOL_DTYPE=TRITON_DTYPES[pool_dtype], SPLITS=splits, DOT_BF16=dot_bf16,
        UPCAST=INTERPRETED, enable_fp_fusion=True, num_warps=KEY_WARPS, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        block_c = min(COMBINE_COLUMNS, block_dc)
        _combine_splits_kernel[(num_tokens, head_blocks, triton.cdiv(kv_lora_rank, block_c))](
            part, lse, out, H=num_heads, DC=kv_lora_rank, SPLITS=splits, BLOCK_H=block_h, BLOCK_C=block_c,
        )  # fmt: skip


def aot_compile(
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    scale: float,
    capability: int,
    block_h: int = 16,
    block_k: int | None = None,
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
    default_k, stages = aot_key_tiles(pool_dtype)
    block_k = block_k or default_k
    signature = dict(
        q_ptr="*fp32", pool_table_ptr="*i64", new_ptr="*fp32", cu_seqlens_ptr="*i64", block_tables_ptr="*i64",
        pos_ptr="*i64", idx_ptr="*i64", pool_index="i32", num_seqs="i32", num_tokens="i32", block_size="i32",
        table_width="i32", num_idx="i32",
        o_ptr="*fp32",
    )  # fmt: skip
    constexprs = dict(
        part_ptr=None, lse_ptr=None,  # one split: the program writes o itself (a single launch, as TensorRT's AOT)
        scale=float(scale), H=num_heads, DC=kv_lora_rank, DR=rope_dim,
        BLOCK_DC=block_dc, BLOCK_DR=block_dr, BLOCK_H=block_h, BLOCK_K=block_k, POOL_FP8=pool_dtype == torch.uint8,
        POOL_DTYPE=TRITON_DTYPES[pool_dtype], SPLITS=1, DOT_BF16=pool_dtype in (torch.bfloat16, torch.uint8), UPCAST=False,
    )  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=_sparse_mla_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=aot_compile_options(enable_fp_fusion=True, num_warps=KEY_WARPS, num_stages=stages))

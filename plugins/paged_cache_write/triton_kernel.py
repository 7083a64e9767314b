"""Triton PagedCacheWrite (semantics in `reference.py`): one program per token of the step stores its new row
at the token's block-table row, in place (`out` is the pool itself on TensorRT: the plugin output is aliased).

The token's sequence is found in the kernel (`token_sequence`), so a TensorRT launch needs nothing computed on
the host; every index read from an input is clamped into its buffer (TensorRT times tactics on garbage inputs).
fp8 pools (uint8 rows of D codes + an E8M0 scale byte) are encoded by bit arithmetic with the codec's rules
(`moe_export.quantize.fp8_cache`): the row exponent straight from the exponent bits of the row's max, each value
rounded to E4M3 to nearest even (Triton's own fp8 conversion does not round to nearest even in the interpreter).
Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from ..sparse_mla_attention.triton_kernel import POOL_DTYPES, token_sequence


@triton.jit
def f32_to_e4m3(x):
    """fp32 values with |x| <= 448 -> float8_e4m3fn codes (int32 0..255), rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    a = magnitude.to(tl.float32, bitcast=True)
    # subnormal E4M3 (|x| < 2^-6, steps of 2^-9): round a * 2^9 to an integer (adding 2^23 rounds to nearest even)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # normal: keep 3 of fp32's 23 mantissa bits (round to nearest even), rebias the exponent from 127 to 7
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    code = tl.where(a < 0.015625, sub, normal)
    return code | (sign << 7)


@triton.jit
def _paged_cache_write_kernel(
    pool_ptr, new_ptr, cu_seqlens_ptr, block_tables_ptr, pos_ptr,
    num_seqs, num_tokens, num_blocks, block_size, table_width,
    out_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, POOL_FP8: tl.constexpr,
):
    """pool [NB, block_size, D (+1 if POOL_FP8)], new [T, D] fp32, cu_seqlens [num_seqs+1], block_tables
    [num_seqs, table_width], pos [T] -> out (the pool, or a copy of it) with row t stored at its block-table row
    (none for a token whose table entry is -1)."""
    t = tl.program_id(0).to(tl.int64)
    seq = token_sequence(cu_seqlens_ptr, num_seqs, t)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), table_width.to(tl.int64) * block_size - 1)
    block = tl.load(block_tables_ptr + seq * table_width + pos // block_size).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    used = (offs.to(tl.int64) * 0 + block) >= 0  # -1: no block (decode-graph padding rows): nothing is written
    block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
    row = out_ptr + (block * block_size + pos % block_size) * (D + POOL_FP8)
    mask = (offs < D) & used
    x = tl.load(new_ptr + t * D + offs, mask=mask, other=0.0)
    if POOL_FP8:
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
        amax_bits = amax.to(tl.int32, bitcast=True)
        biased = amax_bits >> 23  # fp32 exponent field of the row max (0: zero / subnormal, 255: inf / nan)
        # smallest e with amax <= 448 * 2^e = 1.75 * 2^(e + 8): E - 8, or E - 7 if the mantissa exceeds 1.75
        e = biased - 127 - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(biased == 0, -127, tl.minimum(tl.maximum(e, -127), 127))
        inverse = tl.where(e == 127, 5.877471754111438e-39, ((127 - e) << 23).to(tl.float32, bitcast=True))  # 2^-e
        codes = f32_to_e4m3(x * inverse)
        tl.store(row + offs, codes.to(tl.uint8), mask=mask)
        scale = tl.zeros([BLOCK_D], tl.int32) + tl.where(biased == 255, 255, e + 127)  # the scale byte, masked
        tl.store(row + D + offs, scale.to(tl.uint8), mask=(offs == 0) & used)
    else:
        tl.store(row + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def paged_cache_write_triton(
    pool: torch.Tensor,
    new_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store new_rows [T, D] fp32 into `out` (default: `pool` itself, in place), a pool [NB, BS, W] (W = D, or
    D + 1 for a uint8 fp8 pool) with cu_seqlens [N+1], block_tables [N, B], positions [T]; returns `out`."""
    out = pool if out is None else out
    num_tokens, dim = new_rows.shape
    if num_tokens == 0 or cu_seqlens.numel() < 2 or pool.shape[0] == 0 or block_tables.shape[1] == 0:
        return out
    _paged_cache_write_kernel[(num_tokens,)](
        pool, new_rows.float().contiguous(), cu_seqlens.to(torch.int64).contiguous(),
        block_tables.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(),
        cu_seqlens.numel() - 1, num_tokens, pool.shape[0], pool.shape[1], block_tables.shape[1],
        out,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), POOL_FP8=pool.dtype == torch.uint8,
    )  # fmt: skip
    return out


def aot_compile(dim: int, capability: int, pool_dtype: torch.dtype = torch.float32):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU) for rows of `dim` values and a
    pool in `pool_dtype` (fp32, bf16, fp16, or uint8: fp8 rows with their scale byte).

    Returns Triton's CompiledKernel. Parameters: pool, new_rows, cu_seqlens, block_tables, positions pointers;
    int32 num_seqs (N), num_tokens (T), num_blocks (NB), block_size (BS), table_width (B); out pointer (the
    aliased pool). Grid (T,).
    """
    from triton.backends.compiler import GPUTarget

    pool_type = POOL_DTYPES[pool_dtype]
    signature = dict(
        pool_ptr=pool_type, new_ptr="*fp32", cu_seqlens_ptr="*i64", block_tables_ptr="*i64", pos_ptr="*i64",
        num_seqs="i32", num_tokens="i32", num_blocks="i32", block_size="i32", table_width="i32", out_ptr=pool_type,
    )  # fmt: skip
    constexprs = dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), POOL_FP8=pool_dtype == torch.uint8)
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=_paged_cache_write_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(enable_fp_fusion=True))

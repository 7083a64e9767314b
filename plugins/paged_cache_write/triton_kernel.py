"""Triton PagedCacheWrite (semantics in `reference.py`): one program per token of the step stores its new row
at the token's block-table row of a pool it reaches through the pool table (`plugins/pool_table.py`: the pool is
no tensor argument, on TensorRT no network input), and copies the row to the node's output.

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

from ..aot_contract import aot_compile_options
from ..pool_table import TRITON_DTYPES, check_pool_offsets, in_pool, pool_entry, pool_table
from ..sparse_mla_attention.triton_kernel import token_sequence
from .inputs import write_inputs


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
    pool_table_ptr, new_ptr, cu_seqlens_ptr, block_tables_ptr, pos_ptr,
    pool_index, num_seqs, num_tokens, block_size, table_width,
    out_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, POOL_FP8: tl.constexpr, POOL_DTYPE: tl.constexpr,
):
    """Pool `pool_index` of the pool table ([NB, block_size, D (+1 if POOL_FP8)] of POOL_DTYPE, NB its capacity),
    new [T, D] fp32, cu_seqlens [num_seqs+1], block_tables [num_seqs, table_width], pos [T]: row t stored at its
    block-table row of the pool (none for a token whose table entry is -1, none at all when the table row is not
    valid), and copied to out [T, D] (the node's output, which orders the pool's readers after the write)."""
    t = tl.program_id(0).to(tl.int64)
    pool_ptr, num_blocks, valid = pool_entry(pool_table_ptr, pool_index, POOL_DTYPE)
    seq = token_sequence(cu_seqlens_ptr, num_seqs, t)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), table_width.to(tl.int64) * block_size - 1)
    block = tl.load(block_tables_ptr + seq * table_width + pos // block_size).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    used = in_pool((offs.to(tl.int64) * 0 + block) >= 0, valid)  # -1: no block (decode-graph padding rows)
    block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
    row = pool_ptr + (block * block_size + pos % block_size) * (D + POOL_FP8)
    x = tl.load(new_ptr + t * D + offs, mask=offs < D, other=0.0)
    tl.store(out_ptr + t * D + offs, x, mask=offs < D)
    mask = (offs < D) & used
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
        tl.store(row + offs, x.to(POOL_DTYPE), mask=mask)


def paged_cache_write_launch(
    pool_table: torch.Tensor,
    pool_index: int,
    block_size: int,
    pool_dtype: torch.dtype,
    new_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    rows_out: torch.Tensor,
) -> None:
    """Store new_rows [T, D] fp32 into pool `pool_index` of `pool_table` (a [NB, block_size, W] pool of
    `pool_dtype`, W = D or D + 1 for fp8) and copy them to rows_out [T, D] fp32. Nothing is checked on the host
    (the TensorRT plugin's path: the table is on the device, and garbage while TensorRT times tactics is handled
    in the kernel); whoever builds the table checks it (`pool_table`)."""
    new_rows, cu, tables, positions = write_inputs(new_rows, cu_seqlens, block_tables, positions, None)
    num_tokens, dim = new_rows.shape
    if num_tokens == 0:
        return
    if cu.numel() < 2 or tables.shape[1] == 0:
        rows_out.copy_(new_rows)
        return
    _paged_cache_write_kernel[(num_tokens,)](
        pool_table, new_rows, cu, tables, positions,
        pool_index, cu.numel() - 1, num_tokens, block_size, tables.shape[1],
        rows_out,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), POOL_FP8=pool_dtype == torch.uint8,
        POOL_DTYPE=TRITON_DTYPES[pool_dtype],
    )  # fmt: skip


def paged_cache_write_triton(
    pool: torch.Tensor,
    new_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Store new_rows [T, D] fp32 into `pool` [NB, BS, W] (W = D, or D + 1 for a uint8 fp8 pool) in place, through
    a pool table of that one pool (the kernel gets the pool's address only from the table); returns the pool.
    The table and the block ids are checked before anything is launched (`pool_table.PoolTableError`)."""
    new_rows, cu_seqlens, block_tables, positions = write_inputs(new_rows, cu_seqlens, block_tables, positions, pool)
    if pool.shape[0] == 0:
        return pool
    table = pool_table([pool])
    check_pool_offsets(table, 0, block_tables=block_tables.cpu().numpy())
    rows_out = torch.empty(new_rows.shape, dtype=torch.float32, device=new_rows.device)
    paged_cache_write_launch(torch.from_numpy(table).to(pool.device), 0, pool.shape[1], pool.dtype, new_rows, cu_seqlens,
                             block_tables, positions, rows_out)
    return pool


def aot_compile(dim: int, capability: int, pool_dtype: torch.dtype = torch.float32):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU) for rows of `dim` values and a
    pool in `pool_dtype` (fp32, bf16, fp16, or uint8: fp8 rows with their scale byte).

    Returns Triton's CompiledKernel. Parameters: pool_table, new_rows, cu_seqlens, block_tables, positions
    pointers; int32 pool_index, num_seqs (N), num_tokens (T), block_size (BS), table_width (B); the rows_out
    pointer. Grid (T,).
    """
    from triton.backends.compiler import GPUTarget

    signature = dict(
        pool_table_ptr="*i64", new_ptr="*fp32", cu_seqlens_ptr="*i64", block_tables_ptr="*i64", pos_ptr="*i64",
        pool_index="i32", num_seqs="i32", num_tokens="i32", block_size="i32", table_width="i32", out_ptr="*fp32",
    )  # fmt: skip
    constexprs = dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), POOL_FP8=pool_dtype == torch.uint8,
                      POOL_DTYPE=TRITON_DTYPES[pool_dtype])
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=_paged_cache_write_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=aot_compile_options(enable_fp_fusion=True))  # PTX TensorRT's driver loads

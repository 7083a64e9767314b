"""Shared pieces of the OCP Microscaling (MX v1.0) codecs: block checks and E8M0 shared scales.

A block is 32 consecutive elements along the last dim. Its E8M0 scale byte s encodes 2^(s-127);
s = 255 is NaN. The shared exponent is floor(log2(amax)) - emax_elem, read straight from the
exponent bits of the block's amax and clamped at the bottom of the E8M0 range (byte 0 = 2^-127).
"""

from __future__ import annotations

import torch
from moe_export.common.errors import InputError

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# Blocks per step of the codecs' chunk loop (1 Mi elements): keeps temporaries in cache.
CHUNK_BLOCKS = 1 << 15

# Per input dtype: (integer view dtype, exponent shift, magnitude mask, +Inf bit pattern).
_BITS = {
    torch.float32: (torch.int32, 23, 0x7FFFFFFF, 0x7F800000),
    torch.bfloat16: (torch.int16, 7, 0x7FFF, 0x7F80),
}


def check_blocks(x: torch.Tensor, what: str) -> None:
    """Raise InputError unless x has a last dim that is a positive multiple of BLOCK_SIZE."""
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise InputError(
            f"{what}: the last dimension of shape {tuple(x.shape)} must be a multiple of the MX block "
            f"size {BLOCK_SIZE}; MX tensors are never padded silently"
        )


def check_input_dtype(x: torch.Tensor, what: str) -> None:
    """Raise InputError unless x is bf16, fp16 or fp32."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{what}: input dtype {x.dtype} is not supported (bf16, fp16 or fp32)")


def block_scales(xb: torch.Tensor, emax_elem: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E8M0 scales and the exact power-of-two multipliers of a chunk of blocks.

    xb: [B, 32] bf16 or fp32. Returns (scales uint8 [B], mult [B, 1] in xb's dtype) where
    mult = 2^(127 - s) = 1 / 2^(s - 127) for finite blocks and 0 for NaN blocks (s = 255), so that
    xb * mult maps finite elements of a NaN block to signed zeros. An Inf amax has exponent field
    255 and yields s = 255 - emax_elem (as torchao does); the elements saturate afterwards.
    """
    int_dtype, shift, mag_mask, inf_bits = _BITS[xb.dtype]
    amax_bits = torch.amax(xb.view(int_dtype) & mag_mask, dim=-1)
    is_nan = amax_bits > inf_bits
    biased = torch.clamp_min((amax_bits >> shift).to(torch.int32) - emax_elem, 0)
    scales = torch.where(is_nan, E8M0_NAN, biased).to(torch.uint8)
    # 2^(127 - s) has exponent field 254 - s, in [1, 254] for s in [0, 253].
    mult_bits = torch.where(is_nan, 0, (2 * E8M0_BIAS - biased) << shift).to(int_dtype)
    return scales, mult_bits.view(xb.dtype).unsqueeze(-1)


def e8m0_to_float(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scale bytes (uint8 or float8_e8m0fnu) -> 2^(s-127) in `dtype` (fp32 or bf16); 255 -> NaN.

    Byte 0 gives 2^-127, a subnormal in both fp32 and bf16.
    """
    s = scales.view(torch.uint8).to(torch.int32)
    if dtype == torch.float32:
        bits = torch.where(s == 0, 1 << 22, s << 23)
        bits = torch.where(s == E8M0_NAN, 0x7FC00000, bits)
        return bits.view(torch.float32)
    if dtype == torch.bfloat16:
        bits = torch.where(s == 0, 1 << 6, s << 7)
        bits = torch.where(s == E8M0_NAN, 0x7FC0, bits)
        return bits.to(torch.int16).view(torch.bfloat16)
    raise ValueError(f"e8m0_to_float: dtype {dtype} (fp32 or bf16)")

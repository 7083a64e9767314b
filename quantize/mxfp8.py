"""MXFP8 (OCP Microscaling v1.0): E4M3 elements in blocks of 32 along the last dim, E8M0 scales.

Encoding of a block with amax = max|x|:
  s = clamp(floor(log2 amax) - 8 + 127, 0, 254)      (E8M0 byte; amax NaN -> 255)
  e_i = float8_e4m3fn(clamp(x_i / 2^(s-127), -448, 448))   (round-to-nearest-even)
Decoding: x_i = e_i * 2^(s-127); s = 255 decodes the whole block to NaN.

Bit-identical to torchao `to_mx(x, torch.float8_e4m3fn, 32, FLOOR)` except for blocks with
amax < 2^-118 (E8M0 byte 0), which are quantized against 2^-127 as the spec says where torchao
uses 2^-126. NaN blocks: finite elements become +-0, NaN elements stay NaN. Inf saturates to
+-448 against s = 247 (the exponent field of Inf minus 8), as in torchao.
"""

from __future__ import annotations

import torch
from moe_export.common.errors import InputError
from moe_export.quantize.mx_common import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    block_scales,
    check_blocks,
    check_input_dtype,
    e8m0_to_float,
)

E4M3_MAX = 448.0
EMAX_ELEM = 8  # floor(log2(448))


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., n] (bf16/fp16/fp32, n % 32 == 0) to MXFP8.

    Returns (data float8_e4m3fn [..., n], scales uint8 [..., n/32]).
    """
    check_input_dtype(x, "mxfp8.encode")
    check_blocks(x, "mxfp8.encode")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    data = torch.empty(*lead, n, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(*lead, n // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    xb = x.contiguous().view(-1, BLOCK_SIZE)
    db = data.view(-1, BLOCK_SIZE)
    sb = scales.view(-1)
    for b0 in range(0, xb.shape[0], CHUNK_BLOCKS):
        chunk = xb[b0 : b0 + CHUNK_BLOCKS]
        if chunk.dtype == torch.float16:
            chunk = chunk.float()
        s, mult = block_scales(chunk, EMAX_ELEM)
        sb[b0 : b0 + CHUNK_BLOCKS] = s
        db[b0 : b0 + CHUNK_BLOCKS] = torch.clamp(chunk * mult, -E4M3_MAX, E4M3_MAX)
    return data, scales


def decode(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize MXFP8: data float8_e4m3fn (or its uint8 bytes) [..., n] + scales uint8 (or
    float8_e8m0fnu) [..., n/32] -> [..., n] in `dtype` (computed in fp32, exact there, then cast)."""
    data = data.view(torch.float8_e4m3fn)
    scales = scales.view(torch.uint8)
    if data.dim() == 0 or scales.dim() == 0 or data.shape[:-1] != scales.shape[:-1] or data.shape[-1] != scales.shape[-1] * BLOCK_SIZE:
        raise InputError(
            f"mxfp8.decode: data shape {tuple(data.shape)} and scales shape {tuple(scales.shape)} do not match "
            f"(expected [..., n] and [..., n/{BLOCK_SIZE}])"
        )
    vals = data.to(torch.float32).view(*scales.shape, BLOCK_SIZE)
    out = (vals * e8m0_to_float(scales).unsqueeze(-1)).view(data.shape)
    return out if dtype == torch.float32 else out.to(dtype)

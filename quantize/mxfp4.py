"""MXFP4 (OCP Microscaling v1.0): E2M1 elements in blocks of 32 along the last dim, E8M0 scales.

Encoding of a block with amax = max|x|:
  s = clamp(floor(log2 amax) - 2 + 127, 0, 254)      (E8M0 byte; amax NaN -> 255)
  code_i = E2M1(x_i / 2^(s-127))                       (round-to-nearest-even, saturate to +-6)
Two codes per byte, LOW nibble = even element. Decoding: x_i = E2M1_VALUES[code_i] * 2^(s-127),
and s = 255 decodes the whole block to NaN.

Special values (bit-identical to torchao `to_mx(..., FLOOR)` except where noted):
  * a value that rounds to zero keeps its sign (code 8 = -0); all-zero blocks get s = 0.
  * a NaN in a block gives s = 255; finite elements of that block encode as +-0, NaN elements as
    code 3 (with the NaN's sign), torchao's result for the canonical NaN. Element codes of a NaN
    block carry no information.
  * +-Inf (no NaN) gives s = 253 (the exponent field of Inf); Inf saturates to +-6 and the finite
    elements round against 2^126.
  * blocks with amax < 2^-124 get s = 0 and are quantized against 2^-127 as the spec says;
    torchao quantizes them against 2^-126 (its scale is clamped to the smallest normal fp32),
    which makes its codes decode to half their input.

Rounding uses a code table indexed by the bit pattern of the scaled value: a bf16 pattern (exact
for bf16 input) or, for fp32, the top 16 bits with a sticky bit for the 16 dropped bits (every
E2M1 rounding boundary is a bf16 value, so that is exact too).
"""

from __future__ import annotations

import functools

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

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EMAX_ELEM = 2  # floor(log2(6))
_NAN_CODE = 3  # torchao's code for a canonical NaN


def e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """Reference E2M1 code (uint8, sign in bit 3) of fp32 values already divided by the scale.

    Round-to-nearest-even with saturation; each comparison is one RNE decision boundary
    (ties at 0.25, 1.25, 2.5, 5 go down to the even code, ties at 0.75, 1.75, 3.5 go up).
    """
    a = v.abs()
    code = (
        (a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
        + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int()
    )
    code = torch.where(torch.isnan(a), _NAN_CODE, code)
    sign = (v.view(torch.int32) < 0).int() << 3
    return (code | sign).to(torch.uint8)


@functools.cache
def _code_table(index_bits: int) -> torch.Tensor:
    """Codes of every fp32 value whose bits are (i << (32 - index_bits)), i < 2^index_bits."""
    i = torch.arange(1 << index_bits, dtype=torch.int64) << (32 - index_bits)
    bits = torch.where(i >= 1 << 31, i - (1 << 32), i).to(torch.int32)
    return e2m1_code(bits.view(torch.float32))


@functools.cache
def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] values of one packed byte (low nibble, high nibble) in `dtype` (fp32 or bf16), each pair
    stored as one int64 / int32 so that a byte decodes with a single 1-D gather."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    pairs = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=-1).to(dtype)
    return pairs.view(torch.int64 if dtype == torch.float32 else torch.int32).view(256)


def _encode_chunk(xb: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Encode blocks xb [B, 32] (bf16/fp32) into packed [B, 16] and scales [B] (uint8, in place)."""
    s, mult = block_scales(xb, EMAX_ELEM)
    scales.copy_(s)
    v = xb * mult
    if v.dtype == torch.bfloat16:
        idx = v.view(torch.uint16).to(torch.int32)
        table = _code_table(16)
    else:
        b = v.view(torch.int32)
        # 2*top16 + sticky(low16) = floor(b / 2^16) + ceil(b / 2^16), masked to 17 bits.
        idx = ((b >> 16) + ((b + 0xFFFF) >> 16)) & 0x1FFFF
        table = _code_table(17)
    codes = torch.index_select(table.to(v.device), 0, idx.view(-1))
    # Little-endian int16 view of a code pair: even code in bits 0-3, odd code in bits 8-11.
    pairs = codes.view(torch.int16).view(-1, BLOCK_SIZE // 2)
    packed.copy_(pairs | (pairs >> 4))


def encode(
    x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., n] (bf16/fp16/fp32, n % 32 == 0) to MXFP4.

    Returns (packed uint8 [..., n/2], scales uint8 [..., n/32]). With `out`, writes into those two
    contiguous uint8 tensors (same shapes) and returns them.
    """
    check_input_dtype(x, "mxfp4.encode")
    check_blocks(x, "mxfp4.encode")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    if out is None:
        packed = torch.empty(*lead, n // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(*lead, n // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    else:
        packed, scales = out
        want = ((*lead, n // 2), (*lead, n // BLOCK_SIZE))
        if (tuple(packed.shape), tuple(scales.shape)) != want or packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise InputError(f"mxfp4.encode: out tensors must be uint8 of shapes {want[0]} and {want[1]}")
        if not (packed.is_contiguous() and scales.is_contiguous()):
            raise InputError("mxfp4.encode: out tensors must be contiguous")
    xb = x.contiguous().view(-1, BLOCK_SIZE)
    pb = packed.view(-1, BLOCK_SIZE // 2)
    sb = scales.view(-1)
    for s0 in range(0, xb.shape[0], CHUNK_BLOCKS):
        chunk = xb[s0 : s0 + CHUNK_BLOCKS]
        if chunk.dtype == torch.float16:
            chunk = chunk.float()
        _encode_chunk(chunk, pb[s0 : s0 + CHUNK_BLOCKS], sb[s0 : s0 + CHUNK_BLOCKS])
    return packed, scales


def decode(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize MXFP4: packed uint8 [..., n/2] + scales uint8 [..., n/32] -> [..., n] in `dtype`.

    Also accepts torch.float4_e2m1fn_x2 packed data and float8_e8m0fnu scales (viewed as bytes).
    fp32 and bf16 results are exact; other dtypes are computed in fp32 and cast.
    """
    packed = packed.view(torch.uint8)
    scales = scales.view(torch.uint8)
    if packed.dim() == 0 or scales.dim() == 0 or packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * (BLOCK_SIZE // 2):
        raise InputError(
            f"mxfp4.decode: packed shape {tuple(packed.shape)} and scales shape {tuple(scales.shape)} do not "
            f"match (expected [..., n/2] and [..., n/{BLOCK_SIZE}])"
        )
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    lead, nb = tuple(scales.shape[:-1]), scales.shape[-1]
    out = torch.empty(*lead, nb * BLOCK_SIZE, dtype=work, device=packed.device)
    ob = out.view(-1, BLOCK_SIZE)
    pb = packed.contiguous().view(-1)
    sb = scales.contiguous().view(-1)
    table = _pair_table(work).to(packed.device)
    step = CHUNK_BLOCKS
    for b0 in range(0, sb.shape[0], step):
        vals = torch.index_select(table, 0, pb[b0 * 16 : (b0 + step) * 16].to(torch.int32)).view(work)
        sc = e8m0_to_float(sb[b0 : b0 + step], work).unsqueeze(-1)
        torch.mul(vals.view(-1, BLOCK_SIZE), sc, out=ob[b0 : b0 + step])
    return out if work == dtype else out.to(dtype)

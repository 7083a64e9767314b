"""FP8 E4M3 cache rows with one power-of-two (E8M0) scale per row: the `kv_cache: fp8` storage of the paged
MLA latent and DSA indexer-key pools.

A cached row of D values (one token of one layer: 576 latent values for K3, 128 indexer-key values) is stored as
D + 1 bytes, the layout of a `uint8` pool [NB, BS, D + 1]:

    bytes [0, D)   float8_e4m3fn codes of row / 2^e          (OCP FP8 E4M3, "fn": no inf, 0x7F/0xFF = NaN)
    byte  D        E8M0 scale byte e + 127                   (2^(byte - 127); 255 = NaN: a non-finite row)

with e = the smallest integer in [-127, 127] such that max|row| <= 448 * 2^e, so nothing saturates; an all-zero row
has e = -127. A power-of-two scale costs nothing in precision (E4M3 keeps 3 mantissa bits at any magnitude) and
keeps encode -> decode -> encode exact, so values the graph has rounded are stored without a second rounding.
One scale per row, not per block: rows of a block arrive over many steps and a block scale would force
re-quantizing the block's earlier rows (lossy, O(block) per step). Byte-packing the scale into the row follows
DeepSeek's FlashMLA FP8 cache (656-byte rows: FP8 values, fp32 tile scales, bf16 rope in one byte row); the
planner counts D + 1 bytes per row (`plugins.paged_cache_write.sizes.row_bytes`).

Every implementation decodes the same way: torch (`decode_rows`, the reference and CPU kernels), ONNX Runtime
(two 256-entry lookup tables, `code_table` and `scale_table`, in the ops' function bodies), Triton (bit
arithmetic in the kernels). The graph rounds a step's new rows with the same rule in ONNX ops
(`graphs.onnx_export`); the runtime encodes them with `encode_rows`.
"""

from __future__ import annotations

import numpy as np
import torch

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_BYTES = 1  # per row


def row_exponents(rows: torch.Tensor) -> torch.Tensor:
    """Scale exponents e [..., 1] int32 of fp32 rows [..., D]: smallest e in [-127, 127] with max|row| <= 448 * 2^e
    (-127 for an all-zero row). Non-finite rows give a garbage exponent (`encode_rows` marks them NaN)."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float()
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).nan_to_num(nan=0.0, posinf=127.0, neginf=-127.0).clamp(-127, 127)
    # log2 of a float is not exactly rounded: step to the exact smallest e (one step at most either way)
    e = torch.where((e > -127) & (amax <= E4M3_MAX * torch.exp2(e - 1)), e - 1, e)
    e = torch.where((e < 127) & (amax > E4M3_MAX * torch.exp2(e)), e + 1, e)
    return e.to(torch.int32)


def encode_rows(rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows [..., D] -> uint8 [..., D + 1]: E4M3 codes of rows / 2^e (round to nearest even), then the E8M0
    scale byte."""
    rows = rows.float()
    e = row_exponents(rows)
    codes = (rows * torch.exp2(-e.float())).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = (e + E8M0_BIAS).to(torch.uint8)
    scale = torch.where(torch.isfinite(rows).all(dim=-1, keepdim=True), scale, torch.full_like(scale, E8M0_NAN))
    return torch.cat([codes, scale], dim=-1)


def decode_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D + 1] -> fp32 rows [..., D] (codes x 2^(scale byte - 127); NaN where the scale byte is 255)."""
    values = packed[..., :-1].contiguous().view(torch.float8_e4m3fn).float()
    return values * scale_values(packed[..., -1:])


def scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> fp32 2^(byte - 127), NaN for 255."""
    e = scale_bytes.to(torch.int32)
    return torch.where(e == E8M0_NAN, float("nan"), torch.exp2((e - E8M0_BIAS).float()))


def round_rows(rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows [..., D] as the fp8 pool stores them (decode(encode(rows)))."""
    return decode_rows(encode_rows(rows))


def code_table() -> np.ndarray:
    """[256] fp32: the value of every float8_e4m3fn code (byte b -> value), NaN for 0x7F and 0xFF."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def scale_table() -> np.ndarray:
    """[256] fp32: the scale of every E8M0 byte, 2^(b - 127) (2^-127 is an fp32 subnormal), NaN for 255."""
    return scale_values(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy()

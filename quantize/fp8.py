"""FP8 E4M3 with 128x128 block scales for 2-D dense weights (DeepSeek-V3 `weight_scale_inv` layout).

For weight W [R, C] and block (i, j) = W[128i : 128i+128, 128j : 128j+128]:
  amax = max|block|;  scale_inv[i, j] = 1 / (448 / amax)   (fp32; 1.0 for an all-zero block)
  q = float8_e4m3fn(clamp(block * (448 / amax), -448, 448))
  W ~= q * scale_inv[i, j]
This is the arithmetic of transformers' fine-grained FP8 quantizer (bit-identical on whole blocks).
When R or C is not a multiple of 128 the last block row / column is a partial edge block: it
covers only the remaining rows / columns and its amax is taken over them, so scale_inv has shape
[ceil(R/128), ceil(C/128)] and nothing is padded in the output. Non-finite inputs are not
rejected here (see export.transforms); a NaN makes its block's scale NaN.
"""

from __future__ import annotations

import torch
from moe_export.common.errors import InputError

E4M3_MAX = 448.0
FP8_BLOCK = 128


def _check_2d(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2 or t.numel() == 0:
        raise InputError(f"{what}: expected a non-empty 2-D weight [rows, cols], got shape {tuple(t.shape)}")


def _grid(rows: int, cols: int, block: int) -> tuple[int, int]:
    return -(-rows // block), -(-cols // block)


def _per_column(s: torch.Tensor, cols: int, block: int) -> torch.Tensor:
    """Per-block-column values [gc] -> per-column [cols] (the edge block cut to size)."""
    return s.repeat_interleave(block)[:cols]


def encode(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight [R, C] (bf16/fp16/fp32) -> (q float8_e4m3fn [R, C], scale_inv fp32
    [ceil(R/block), ceil(C/block)]). Works one strip of `block` rows at a time (fp32 temporaries of
    one strip only)."""
    _check_2d(w, "fp8.encode")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"fp8.encode: input dtype {w.dtype} is not supported (bf16, fp16 or fp32)")
    rows, cols = w.shape
    gr, gc = _grid(rows, cols, block)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=w.device)
    scale_inv = torch.empty(gr, gc, dtype=torch.float32, device=w.device)
    for i in range(gr):
        strip = w[i * block : (i + 1) * block].float()
        col_amax = strip.abs().amax(dim=0)
        amax = torch.nn.functional.pad(col_amax, (0, gc * block - cols)).view(gc, block).amax(dim=1)
        mult = torch.where(amax > 0, E4M3_MAX / amax, 1.0)
        scale_inv[i] = 1.0 / mult
        q[i * block : (i + 1) * block] = torch.clamp(strip * _per_column(mult, cols, block), -E4M3_MAX, E4M3_MAX)
    return q, scale_inv


def decode(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK) -> torch.Tensor:
    """Dequantize q float8_e4m3fn [R, C] with scale_inv fp32 [ceil(R/block), ceil(C/block)] -> [R, C]."""
    _check_2d(q, "fp8.decode")
    rows, cols = q.shape
    if tuple(scale_inv.shape) != _grid(rows, cols, block):
        raise InputError(
            f"fp8.decode: scale_inv shape {tuple(scale_inv.shape)} does not match weight shape {(rows, cols)} "
            f"with {block}x{block} blocks (expected {_grid(rows, cols, block)})"
        )
    q = q.view(torch.float8_e4m3fn)
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    for i in range(scale_inv.shape[0]):
        sl = slice(i * block, (i + 1) * block)
        out[sl] = q[sl].to(torch.float32) * _per_column(scale_inv[i].float(), cols, block)
    return out

"""The MXFP4 weight layout the Triton MoE kernels read (`triton_kernel.py`), made at build time, and its inverse.

Same shape, dtype and scale bytes as the standard layout of `reference.py` (packed uint8 [..., n/2], low nibble =
even element; E8M0 scales [..., n/32] untouched): only the bits inside each little-endian 32-bit word (the 8
consecutive values k = 8j .. 8j+7 of a row) move, so that a few instructions turn a word into four bf16 pairs.
Word j holds value 8j + 2X + L in lane L (bits 16L .. 16L+15) of pair X in {0, 1, 2, 3}; the value's E2M1 bits
(s e1 e0 m) sit where one left rotation of the word by r and a mask move them to a bf16's sign (15) and its
exponent / mantissa bits 8, 7, 6 of lane L (lane 1: the lane 0 positions + 16, mod 32):

    X   bits of the word (lane 0) holding  m  e0  e1   s     the kernel's pair (uint32 word w, rotl = rotate left)
    0                                      6   7   8  15     w & 0x81C081C0
    1                                      2   3   4  11     rotl(w, 4) & 0x81C081C0
    2                                     28  29  30   5     rotl(w, 10) & 0x81C081C0
    3                                      0   1  26   9     (rotl(w, 6) & 0x80C080C0) | (rotl(w, 14) & 0x01000100)

A pair is then two bf16 holding value x 2^-126 (E2M1 subnormals included), and one bf16x2 multiply by the block
scale times 2^126, 2^(s-1), gives the values exactly; 2^(s-1) is a bf16 for scale bytes s <= 128 (block scales
up to 2, weights up to 12 in magnitude), which `check_scales` asks of the experts at build time.
The bit placement follows the idea of OpenAI triton_kernels' Hopper value layout (`hopper_value.py`: bf16 bit
positions prepared so that a mask and a multiply decode); the placement here is our own.
"""

import torch

STANDARD = "standard"  # a weights file's `mxfp4_layout` metadata: the bytes of `reference.py` (CPU and ORT kernels)
KERNEL = "triton-kernel-v2"  # ... this module's layout (Triton kernels: TensorRT builds, torch runner on GPUs); v2: rotations
# pair X -> the bit of the word holding each of the value's E2M1 bits m, e0, e1, s in lane 0 (lane 1: + 16, mod 32)
_BITS = {0: (6, 7, 8, 15), 1: (2, 3, 4, 11), 2: (28, 29, 30, 5), 3: (0, 1, 26, 9)}
MAX_SCALE_BYTE = 128  # 2^(s-1) must be a finite bf16


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n/2] (standard) -> E2M1 codes int32 [..., n/8, 8] (value order)."""
    b = packed.to(torch.int32)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # [..., n]
    return codes.unflatten(-1, (-1, 8))


def to_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """Standard MXFP4 bytes [..., n/2] uint8 (n % 8 == 0) -> the kernel layout, same shape and dtype."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"to_kernel_layout: packed must be uint8 [..., n/2] with n % 8 == 0, got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    codes = _codes(packed)
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=packed.device)
    for x, positions in _BITS.items():
        for lane in (0, 1):
            code = codes[..., 2 * x + lane].to(torch.int64)
            for bit, pos in enumerate(positions):
                word |= ((code >> bit) & 1) << ((pos + 16 * lane) % 32)
    return _words_to_bytes(word, packed.shape)


def _words_to_bytes(word: torch.Tensor, shape) -> torch.Tensor:
    """int64 words [..., n/8] holding 32-bit values -> little-endian uint8 bytes of `shape` [..., n/2]."""
    parts = [((word >> (8 * i)) & 255).to(torch.uint8) for i in range(4)]
    return torch.stack(parts, dim=-1).reshape(shape)


def from_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_kernel_layout`: kernel-layout bytes [..., n/2] -> standard MXFP4 bytes."""
    b = packed.to(torch.int64).unflatten(-1, (-1, 4))
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [..., n/8]
    codes = []
    for x in range(4):
        for lane in (0, 1):
            code = torch.zeros_like(word)
            for bit, pos in enumerate(_BITS[x]):
                code |= ((word >> ((pos + 16 * lane) % 32)) & 1) << bit
            codes.append(code)
    c = torch.stack(codes, dim=-1).flatten(-2).unflatten(-1, (-1, 2))  # [..., n/2, 2] (even, odd)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def check_scales(scales: torch.Tensor, name: str) -> None:
    """ValueError naming `name` when an E8M0 scale byte is above `MAX_SCALE_BYTE` (the kernel layout's bound)."""
    if scales.numel() and int(scales.max()) > MAX_SCALE_BYTE:
        where = [int(i) for i in (scales > MAX_SCALE_BYTE).nonzero()[0]]
        raise ValueError(f"{name}: E8M0 scale byte {int(scales.max())} at {where} is above {MAX_SCALE_BYTE} (block "
                         "scale 2): the Triton MoE kernel's layout holds block scales up to 2 only")  # fmt: skip


def kernel_experts(w13_packed, w13_scale, w2_packed, w2_scale) -> tuple[torch.Tensor, ...]:
    """The four expert tensors of `reference.py` as the Triton kernel reads them: packed bytes in the kernel
    layout, scales as they are (checked: `check_scales`)."""
    check_scales(w13_scale, "w13_scale")
    check_scales(w2_scale, "w2_scale")
    return to_kernel_layout(w13_packed), w13_scale, to_kernel_layout(w2_packed), w2_scale

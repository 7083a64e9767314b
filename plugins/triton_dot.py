"""`mma`: the matrix product the Triton kernels share, acc + a @ b with fp32 accumulation.

bf16 / fp16 operands run on the tensor cores; fp32 operands give exact fp32 products (`input_precision="ieee"`).
Triton's interpreter multiplies bf16 blocks as their raw 16-bit integers (triton 3.9), so there (TRITON_INTERPRET=1,
`INTERPRETED`) the product takes fp32 copies of the operands: the products a bf16 MMA makes, exact in fp32.
"""

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # pass as the kernels' UPCAST constexpr


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b (a [M, K], b [K, N] of one dtype; acc [M, N] fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision="ieee")

"""The tolerance for comparing two float32 runs of the same model that differ only in the order of their sums
(prefill chunks, a kept session's state, another CPU's vector width)."""

from __future__ import annotations

import math

import numpy as np
import torch

U32 = 2.0**-24  # float32 unit roundoff
U16 = 2.0**-11  # float16 unit roundoff
BF16_U = 2.0**-8  # bfloat16 unit roundoff (8 significand bits)


def reorder_atol(reference: np.ndarray, layers: int, longest_sum: int) -> float:
    """|a - b| bound for logits `a`, `b` computed by the same float32 arithmetic in two summation orders.

    A reordered n-term float32 sum moves by at most 2 (n - 1) u sum|terms| (each order within (n - 1) u of the exact
    sum; Higham, Accuracy and Stability of Numerical Algorithms, 4.2); the rounding errors of a long sum behave as a
    random walk, so its typical move is sqrt(n) u at the scale of the result (Higham 2.8). Each of the model's
    `layers` layers adds such a move to the residual stream, the longest of its sums running over `longest_sum`
    terms (the attended positions, or the hidden width), and the logits carry them at their own scale: the bound is
    2 layers sqrt(longest_sum) u max|reference| (2: both runs round)."""
    return 2 * layers * math.sqrt(longest_sum) * U32 * float(np.abs(reference).max())


def num_layers(model_config: dict) -> int:
    """The decoder layers of an engine's HF config (a K3 config nests them in text_config)."""
    return int((model_config.get("text_config") or model_config)["num_hidden_layers"])


def longest_sum(cfg, positions: int) -> int:
    """The longest sum of a reference model's forward over `positions` tokens: attention over the positions, or a
    matmul over the hidden, dense or expert width (`cfg`: a ModelConfig)."""
    return max(positions, cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size)


def vision_reorder_atol(reference: np.ndarray, vc, tokens: int) -> float:
    """reorder_atol for a vision tower's output over `tokens` patches (`vc`: a VisionConfig): its blocks, the patch
    embedding and the projector each a layer; the longest sum over the patches, a patch's pixels or a width."""
    longest = max(tokens, 3 * vc.patch_size**2, vc.hidden_size, vc.qkv_hidden_size, vc.intermediate_size,
                  vc.mm_hidden_size)
    return reorder_atol(reference, vc.num_layers + 2, longest)


# A W <= 4 tap float32 depthwise sum in another order: each order within (W - 1) u sum|terms| of the exact sum
# (Higham 4.2), 2 (W - 1) u = 6u between them; SiLU (exp, add, divide, multiply) adds ~4u per side, 8u: 14u.
# Relative to max|y|: for these N(0,1) inputs the element with the largest |y| has sum|terms| ~ |y| (W <= 4 terms
# of one sign dominate there), so 16u at the scale of max|y| covers it.
CONV_RTOL = 16 * U32


UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: BF16_U, torch.float16: U16}


def scan_rtol(T, K, V, dtype=torch.float32):
    """Bound on max|a - b| / max|b| for two float32 evaluations of a T-token scan of [K, V] states in different
    orders (recurrent, chunked, tiled), with activations (q, k, v, o) in `dtype`.

    Each token's update and output round sums of at most K + V terms (S^T k over K, the rank-1 update and q^T S
    over K, the chunked form's products over V), each within (K + V) u of exact (Higham 4.2) at the state's
    scale; the gates and beta < 1 carry earlier errors forward without growth, and the T tokens' errors add as a
    random walk (Higham 2.8): sqrt(T) (K + V) u per side, 2 sides. An output rounded to a 16-bit `dtype` adds
    its unit roundoff on each side."""
    u32 = UNIT_ROUNDOFF[torch.float32]
    rounding = 0.0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype]
    return 2 * math.sqrt(T) * (K + V) * u32 + rounding

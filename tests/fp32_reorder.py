"""The tolerance for comparing two float32 runs of the same model that differ only in the order of their sums
(prefill chunks, a kept session's state, another CPU's vector width)."""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff


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

"""Fast CPU MoEMXFP4 (semantics in `reference.py`).

The (token, choice) pairs routed to this rank are grouped by expert; only experts that received tokens are
touched. Each one is dequantized in row tiles of about `_TILE_ELEMS` weights (a byte -> value-pair table
lookup times the block scale), and every tile is used at once by a matmul with all of the expert's tokens, so
no full-size fp32 copy of an expert is ever written. Gate and up tiles cover the same rows, so the activation
is applied tile by tile. Results are scaled by the routing weights and index-added into y.
"""

import functools

import torch

from moe_export.quantize import mxfp4
from moe_export.quantize.mx_common import BLOCK_SIZE, e8m0_to_float

from .reference import ACTIVATIONS, gated_activation

_TILE_ELEMS = 1 << 18


@functools.cache
def _pair_values() -> torch.Tensor:
    """[256, 2] fp32: E2M1 values of a byte's (low, high) nibbles."""
    vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([vals[byte & 0xF], vals[byte >> 4]], dim=-1)


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows: packed [R, C/2] u8, scales [R, C/32] u8 -> [R, C] fp32."""
    rows, half = packed.shape
    vals = _pair_values().index_select(0, packed.reshape(-1).to(torch.int32))
    vals = vals.view(rows, half * 2 // BLOCK_SIZE, BLOCK_SIZE)
    return (vals * e8m0_to_float(scales).unsqueeze(-1)).view(rows, half * 2)


def group_by_expert(expert_ids: torch.Tensor, expert_offset: int, num_local: int):
    """Pairs routed to this rank, grouped by local expert.

    expert_ids [T, k] -> (pairs [P] flat pair index t*k+j sorted by expert (stable), experts [G] local expert
    ids present, counts [G] pairs per present expert).
    """
    local = expert_ids.reshape(-1) - expert_offset
    pairs = torch.nonzero((local >= 0) & (local < num_local)).flatten()
    order = torch.argsort(local[pairs], stable=True)
    pairs = pairs[order]
    experts, counts = torch.unique_consecutive(local[pairs], return_counts=True)
    return pairs, experts, counts


def moe_mxfp4_cpu(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    expert_offset: int,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """x [T, D], expert_ids [T, k], expert_weights [T, k], weights as in `reference.py` -> y [T, D] fp32."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, top_k = expert_ids.shape
    num_local, two_inter, _ = w13_packed.shape
    inter = two_inter // 2
    dim = x.shape[1]
    xf = x.float()
    y = torch.zeros(num_tokens, dim, dtype=torch.float32)
    pairs, experts, counts = group_by_expert(expert_ids, expert_offset, num_local)
    weights = expert_weights.reshape(-1).float()
    rows_up = max(1, _TILE_ELEMS // dim)
    rows_down = max(1, _TILE_ELEMS // inter)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        sel = pairs[start : start + n]
        start += n
        tokens = torch.div(sel, top_k, rounding_mode="floor")
        xs = xf.index_select(0, tokens)  # [n, D]
        act = torch.empty(n, inter, dtype=torch.float32)
        for r0 in range(0, inter, rows_up):
            r1 = min(inter, r0 + rows_up)
            gate = xs @ dequantize_rows(w13_packed[e, r0:r1], w13_scale[e, r0:r1]).T
            up = xs @ dequantize_rows(w13_packed[e, inter + r0 : inter + r1], w13_scale[e, inter + r0 : inter + r1]).T
            act[:, r0:r1] = gated_activation(gate, up, activation, situ_beta, situ_linear_beta)
        act *= weights.index_select(0, sel)[:, None]
        out = torch.empty(n, dim, dtype=torch.float32)
        for d0 in range(0, dim, rows_down):
            d1 = min(dim, d0 + rows_down)
            out[:, d0:d1] = act @ dequantize_rows(w2_packed[e, d0:d1], w2_scale[e, d0:d1]).T
        y.index_add_(0, tokens, out)
    return y

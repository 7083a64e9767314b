"""Fast CPU MoEMXFP4 (semantics in `reference.py`).

The (token, choice) pairs routed to this rank are grouped by expert; only the G experts that received tokens
are touched. Their tokens are laid out as [G, m, D] (m = most pairs of one expert; padding rows have weight 0)
and the G experts are processed together, tile by tile: a tile is the same rows of all G experts, about
`_TILE_ELEMS` weights, dequantized (`quantize.mxfp4.decode`: one gather per byte from a 256-entry table of value
pairs, times the block scale) and consumed at once by a batched matmul, so no full fp32 copy of an expert is ever written and the
number of torch ops (each a parallel region) depends on the weight volume, not on G. Gate and up tiles cover
the same rows, so the activation is applied tile by tile. Results, scaled by the routing weights before the
down projection, are index-added into y.
"""

import torch

from moe_export.quantize import mxfp4

from .inputs import moe_inputs
from .reference import gated_activation

_TILE_ELEMS = 1 << 18


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


def rank_in_group(counts: torch.Tensor) -> torch.Tensor:
    """counts [G] pairs per group, pairs listed group by group -> [P] position of each pair in its group."""
    first = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum()), device=counts.device) - torch.repeat_interleave(first, counts)


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
    num_tokens, top_k, num_local, inter, dim = moe_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale,
                                                          w2_packed, w2_scale, activation)
    y = torch.zeros(num_tokens + 1, dim, dtype=torch.float32)  # row num_tokens absorbs padding rows
    pairs, experts, counts = group_by_expert(expert_ids, expert_offset, num_local)
    if experts.numel() == 0:
        return y[:num_tokens]
    groups, width = experts.numel(), int(counts.max())
    group = torch.repeat_interleave(torch.arange(groups), counts)
    rank = rank_in_group(counts)
    tokens = torch.full((groups, width), num_tokens, dtype=torch.int64)
    tokens[group, rank] = torch.div(pairs, top_k, rounding_mode="floor")
    route = torch.zeros(groups, width, dtype=torch.float32)
    route[group, rank] = expert_weights.reshape(-1).float()[pairs]
    xg = torch.cat([x.float(), x.new_zeros(1, dim, dtype=torch.float32)])[tokens]  # [G, m, D]

    act = torch.empty(groups, width, inter, dtype=torch.float32)
    rows = max(1, _TILE_ELEMS // (groups * dim))
    for r0 in range(0, inter, rows):
        r1 = min(inter, r0 + rows)
        u0, u1 = inter + r0, inter + r1
        gate_w = mxfp4.decode(w13_packed[experts, r0:r1], w13_scale[experts, r0:r1])  # [G, r, D]
        up_w = mxfp4.decode(w13_packed[experts, u0:u1], w13_scale[experts, u0:u1])
        gate = torch.bmm(xg, gate_w.transpose(1, 2))
        up = torch.bmm(xg, up_w.transpose(1, 2))
        act[:, :, r0:r1] = gated_activation(gate, up, activation, situ_beta, situ_linear_beta)
    act *= route[:, :, None]

    out = torch.empty(groups, width, dim, dtype=torch.float32)
    rows = max(1, _TILE_ELEMS // (groups * inter))
    for d0 in range(0, dim, rows):
        d1 = min(dim, d0 + rows)
        down_w = mxfp4.decode(w2_packed[experts, d0:d1], w2_scale[experts, d0:d1])  # [G, r, I]
        out[:, :, d0:d1] = torch.bmm(act, down_w.transpose(1, 2))
    y.index_add_(0, tokens.view(-1), out.view(-1, dim))
    return y[:num_tokens]

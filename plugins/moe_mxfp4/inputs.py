"""The input checks every MoEMXFP4 implementation (reference, cpu, triton) runs before it computes: the activation
and the shapes (host metadata only), giving the problem's sizes. Each implementation then reads x in its own compute
dtype (fp32 on the reference and CPU paths, bf16 on the tensor-core path)."""

from __future__ import annotations

from typing import NamedTuple

import torch

ACTIVATIONS = ("situ", "silu")


class MoESizes(NamedTuple):
    """T tokens, k choices per token, E local experts, I intermediate width, D hidden width."""

    num_tokens: int
    top_k: int
    num_local: int
    inter: int
    dim: int


def moe_inputs(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w13_packed: torch.Tensor,
               w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
               activation: str) -> MoESizes:
    """Checks x [T, D], expert_ids and expert_weights [T, k], the four expert tensors [E, ...] and the activation
    (a ValueError naming what is wrong); returns `MoESizes`."""
    op = "MoEMXFP4"
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, D], got {tuple(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: expert_ids must be [T, k] with T = {x.shape[0]}, got {tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(f"{op}: expert_weights must be [T, k] = {list(expert_ids.shape)}, got "
                         f"{tuple(expert_weights.shape)}")
    experts = {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale}
    if len({t.shape[0] if t.dim() else -1 for t in experts.values()}) != 1 or w13_packed.dim() != 3:
        raise ValueError(f"{op}: the expert tensors must be [E, ...] with one E, got "
                         f"{ {name: tuple(t.shape) for name, t in experts.items()} }")
    num_tokens, top_k = expert_ids.shape
    return MoESizes(num_tokens, top_k, w13_packed.shape[0], w13_packed.shape[1] // 2, x.shape[1])

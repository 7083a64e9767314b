"""The input checks and preparation (and the l2norm) every gated delta scan implementation (reference, cpu, triton)
runs.

Shapes follow fla's ``naive_recurrent_kda``: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``
(log-decay, natural log); beta ``[B, T, H]``; state ``[N, H, K, V]`` fp32 (K-first). With ``cu_seqlens``
(int ``[N+1]``, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``) the batch must be 1 and
holds N packed sequences; otherwise N == B and every sequence has length T.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2 over the last dim) + eps), computed in the dtype of ``x``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Validate shapes; return int64 cu_seqlens ``[N+1]`` over the flattened ``B*T`` token axis."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)}")
    if v.shape != (B, T, H, V):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int64, device=q.device) * T
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B={B}")
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != T:
            raise ValueError(f"cu_seqlens must be [N+1] from 0 to T={T}, got {cu.tolist()}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    N = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
    return cu

"""The input checks and preparation every short_conv implementation (reference, cpu, triton) runs.

x ``[B, T, C]``; weight ``[C, 1, W]`` (as on disk) or ``[C, W]``, taps ordered oldest -> newest, no bias;
state ``[N, C, W-1]``: the last W-1 inputs of each sequence, oldest first. With ``cu_seqlens`` (int
``[N+1]``, non-decreasing, from 0 to T) the batch must be 1 and holds N packed sequences; otherwise N == B.
"""

from __future__ import annotations

import torch


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes; return (weight as fp32 [C, W], int64 cu_seqlens [N+1] over the flattened B*T tokens)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, 1, W] or [C, W] with C={C}, got {tuple(weight.shape)}")
    W = weight.shape[1]
    if cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int64, device=x.device) * T
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B={B}")
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != T:
            raise ValueError(f"cu_seqlens must be [N+1] from 0 to T={T}, got {cu.tolist()}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    N = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"initial_state must be [N, C, W-1] = [{N}, {C}, {W - 1}], got {tuple(initial_state.shape)}")
    return weight.float(), cu

"""Fast CPU short conv: all sequences at once, W contiguous slice products, no per-token loop.

The N sequences are laid out in one buffer with each sequence's W-1 window rows right before its tokens,
``ext = [state_0; x_seq0; state_1; x_seq1; ...]`` ([N(W-1) + T, C]); token t of sequence n sits at row
``e_t = t + (n+1)(W-1)``. Then ``a[i] = sum_j w[:, j] * ext[i + j]`` over all rows i (W slice FMAs),
``y_t = silu(a[e_t - (W-1)])`` and the final window of sequence n is ``ext[cu[n+1] + n(W-1) + i]``,
i < W-1. Same contract as ``reference.short_conv``; fp32 arithmetic.
"""

from __future__ import annotations

import torch

from .inputs import check_inputs


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [B, T, C]; weight: [C, 1, W] or [C, W]; initial_state: [N, C, W-1].
    Returns y [B, T, C] (x's dtype) and the final window [N, C, W-1] fp32 (or None)."""
    w, cu = check_inputs(x, weight, initial_state, cu_seqlens)
    B, T, C = x.shape
    W = w.shape[1]
    N = cu.numel() - 1
    rows = B * T + N * (W - 1)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths)  # [T]
    tok_rows = torch.arange(B * T, device=x.device) + (seq + 1) * (W - 1)  # e_t
    window = torch.arange(W - 1, device=x.device)
    state_rows = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] + window  # [N, W-1]
    ext = torch.zeros(rows, C, dtype=torch.float32, device=x.device)
    ext.index_copy_(0, tok_rows, x.reshape(B * T, C).float())
    if initial_state is not None:
        ext.index_copy_(0, state_rows.reshape(-1), initial_state.float().transpose(1, 2).reshape(-1, C))
    wt = w.t().contiguous()  # [W, C]
    span = rows - W + 1
    a = ext[:span] * wt[0]
    for j in range(1, W):
        a.addcmul_(ext[j : j + span], wt[j])
    a = a if N == 1 else a.index_select(0, tok_rows - (W - 1))  # one sequence: rows 0..T-1 already
    y = (a * torch.sigmoid(a)).reshape(B, T, C).to(x.dtype)
    if not output_final_state:
        return y, None
    final_rows = state_rows + lengths[:, None]
    return y, ext[final_rows].transpose(1, 2).contiguous()

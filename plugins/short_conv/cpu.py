"""Fast CPU short conv: all sequences at once with W row gathers, no per-token loop.

Per call, the windows of the N sequences and the packed tokens are laid out in one buffer
``ext = [state_0 (W-1 rows); ...; state_{N-1}; x_0 .. x_{T-1}]`` ([N(W-1)+T, C]). Tap j of token t (relative
position p = t - bos - (W-1) + j in its sequence n) reads ``ext[N(W-1) + t - (W-1) + j]`` when p >= 0 and the
state row ``ext[n(W-1) + (W-1) + p]`` otherwise; the final window is gathered the same way. Same contract as
``reference.short_conv``; fp32 arithmetic.
"""

from __future__ import annotations

import torch

from .common import check_inputs


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
    if initial_state is None:
        state_rows = x.new_zeros(N * (W - 1), C, dtype=torch.float32)
    else:
        state_rows = initial_state.float().transpose(1, 2).reshape(N * (W - 1), C)
    ext = torch.cat([state_rows, x.float().reshape(B * T, C)])
    rows, final_rows = gather_indices(cu, W)
    taps = ext[rows]  # [T, W, C]
    a = torch.einsum("twc,cw->tc", taps, w)
    y = (a * torch.sigmoid(a)).reshape(B, T, C).to(x.dtype)
    if not output_final_state:
        return y, None
    return y, ext[final_rows].transpose(1, 2).contiguous()


def gather_indices(cu: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``ext`` (see module doc) read by each tap [T, W] and by each final window entry [N, W-1]."""
    N = cu.numel() - 1
    T = int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(N, device=cu.device), lengths)  # [T]
    tok = torch.arange(T, device=cu.device)
    j = torch.arange(W, device=cu.device)
    p = (tok - cu[:-1][seq])[:, None] - (W - 1) + j  # [T, W]
    rows = torch.where(p >= 0, N * (W - 1) + tok[:, None] - (W - 1) + j, seq[:, None] * (W - 1) + (W - 1) + p)
    i = torch.arange(W - 1, device=cu.device)
    pf = lengths[:, None] - (W - 1) + i  # [N, W-1]
    n = torch.arange(N, device=cu.device)[:, None]
    final_rows = torch.where(pf >= 0, N * (W - 1) + cu[:-1, None] + pf, n * (W - 1) + (W - 1) + pf)
    return rows, final_rows

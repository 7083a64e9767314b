"""Naive fp32 reference of the short causal depthwise convolution + SiLU, one token at a time.

Per sequence and channel c, with window s (the previous W-1 inputs, oldest first; zeros or the carried state
at the start of a sequence):

    y_t[c] = silu( sum_{j=0..W-1} w[c, j] * x_{t-W+1+j}[c] )      (taps oldest -> newest, no bias)

The final state is the last W-1 inputs of the sequence, reaching into the initial state when the sequence is
shorter than W-1. Shapes and ``cu_seqlens`` conventions: see ``inputs``.
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
    """Reference conv. x: [B, T, C]; weight: [C, 1, W] or [C, W]; initial_state: [N, C, W-1].

    Returns y [B, T, C] in x's dtype and the final window [N, C, W-1] fp32 (or None).
    """
    w, cu = check_inputs(x, weight, initial_state, cu_seqlens)
    B, T, C = x.shape
    W = w.shape[1]
    N = cu.numel() - 1
    xf = x.float().reshape(B * T, C)
    states = torch.zeros(N, C, W - 1, dtype=torch.float32, device=x.device)
    if initial_state is not None:
        states += initial_state.float()
    y = torch.zeros(B * T, C, dtype=torch.float32, device=x.device)
    for n in range(N):
        window = states[n]
        for t in range(int(cu[n]), int(cu[n + 1])):
            full = torch.cat([window, xf[t][:, None]], dim=1)  # [C, W]
            a = (full * w).sum(1)
            y[t] = a * torch.sigmoid(a)
            window = full[:, 1:]
        states[n] = window
    return y.reshape(B, T, C).to(x.dtype), states if output_final_state else None


def short_conv_node(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics of the ONNX node ``ShortConv`` (see ``onnx_schema``).

    x: [T, C]; weight: [C, W] fp32; conv_pool: [S, C, W-1]; cu_seqlens: [N+1] int64; slot_ids: [N] int64,
    distinct. Sequence n starts from conv_pool[slot_ids[n]] and its final window replaces that slot (cast to
    the pool's dtype); other slots are unchanged. Returns y [T, C] (x's dtype) and conv_pool_out.
    """
    slots = slot_ids.long()
    y, final = short_conv(x[None], weight, conv_pool[slots], output_final_state=True, cu_seqlens=cu_seqlens)
    pool_out = conv_pool.clone()
    pool_out[slots] = final.to(pool_out.dtype)
    return y[0], pool_out

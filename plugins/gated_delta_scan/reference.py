"""Naive fp32 reference of the gated delta scan (KDA core), one token at a time.

Per sequence and head, with fp32 state S in R^{K x V}:

    S   = exp(g_t)[:, None] * S                     # decay row i (key channel) by exp(g_t[i])
    S   = S + beta_t * k_t[:, None] * (v_t - S^T k_t)[None, :]
    o_t = S^T (q_t * scale)                         # read from the UPDATED state

Conventions are those of fla's ``naive_recurrent_kda`` (see ``inputs`` for shapes); ``cu_seqlens`` packs
several sequences into batch 1 and ``use_qk_l2norm_in_kernel`` L2-normalises q and k over K first
(x / sqrt(sum x^2 + 1e-6), in fp32).
"""

from __future__ import annotations

import torch

from .inputs import check_inputs, l2norm


def gated_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference scan.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H];
    initial_state: [N, H, K, V] (N = B, or len(cu_seqlens) - 1); scale defaults to K ** -0.5.
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] fp32 (or None).
    """
    cu = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = cu.numel() - 1
    out_dtype = v.dtype
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.float().reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    states = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        states += initial_state.float()
    o = torch.zeros(B * T, H, V, dtype=torch.float32, device=q.device)
    for n in range(N):
        S = states[n]
        for t in range(int(cu[n]), int(cu[n + 1])):
            S = S * g[t].exp()[:, :, None]
            u = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
            S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * u)
            o[t] = torch.einsum("hk,hkv->hv", q[t], S)
        states[n] = S
    return o.reshape(B, T, H, V).to(out_dtype), states if output_final_state else None


def gated_delta_scan_node(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics of the ONNX node ``GatedDeltaScan`` (see ``onnx_schema``).

    q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; state_pool: [S, H, V, K] fp32 (V-first);
    cu_seqlens: [N+1] int64; slot_ids: [N] int64, distinct. Sequence n starts from
    state_pool[slot_ids[n]] and its final state replaces that slot; other slots are unchanged.
    Returns o [T, H, V] (v's dtype) and state_pool_out [S, H, V, K].
    """
    slots = slot_ids.long()
    h0 = state_pool[slots].float().transpose(-1, -2)  # [N, H, K, V]
    o, final = gated_delta_scan(
        q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )  # fmt: skip
    pool_out = state_pool.clone()
    pool_out[slots] = final.transpose(-1, -2).to(pool_out.dtype)
    return o[0], pool_out

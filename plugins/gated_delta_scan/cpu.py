"""Fast CPU gated delta scan: chunked WY/UT-transform form in fp32 torch, vectorised over heads and chunks.

Same contract as ``reference.gated_delta_scan``. Per chunk of C tokens (local positions 1..C), with
cumulative log-decay G_t = sum_{s<=t} g_s (vector over K), chunk-initial state S0 and scaled queries q:

    A[t, j] = sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c])    (j < t)
    P[t, j] = sum_c q_t[c] k_j[c] exp(G_t[c] - G_j[c])    (j <= t)
    (I + diag(beta) A) [U | W] = [beta v | beta exp(G) k]  (unit lower-triangular solve)
    delta = U - W S0                                         (the scaled "new values", [C, V])
    o     = P U + (exp(G) q - P W) S0
    S_C   = exp(G_C) * S0 + (exp(G_C - G) k)^T delta

Everything except the two state products is independent of S0 and runs batched over all chunks; the
chunks of one sequence are then chained by a loop over chunk index (all sequences at once).

Numerics: every exponent used is a log-decay *difference* G_t - G_j with j <= t (<= 0, no overflow).
A and P are split into 16-token row blocks. Columns before a block factor exactly through the block's first
token r: exp(G_t - G_j) = exp(G_t - G_r) * exp(G_r - G_j), both factors <= 1. Diagonal blocks
factor through the block's middle token m, where |G_t - G_m| <= 8 max|g| (<= 40 for the K3 safe gate
g in (-5, 0)); if some |G_t - G_m| exceeds ``_MAX_MID_EXPONENT`` the diagonal blocks are computed
pairwise instead (exact for any gate, more memory). State and all arithmetic stay fp32.
"""

from __future__ import annotations

import torch

from .inputs import check_inputs, l2norm

CHUNK = 64
_SUB = 16
_MAX_MID_EXPONENT = 50.0


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
    """Chunked scan; shapes as in ``reference.gated_delta_scan``.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H]; initial_state [N, H, K, V].
    Returns o [B, T, H, V] (v's dtype) and the final state [N, H, K, V] fp32 (or None).
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
    state = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state += initial_state.float()
    lengths = cu[1:] - cu[:-1]
    if N > 0 and bool((lengths == 1).all()):
        o = _decode_step(q, k, v, g, beta, state)
    else:
        o = _chunked(q, k, v, g, beta, state, cu)
    return o.reshape(B, T, H, V).to(out_dtype), state if output_final_state else None


def _decode_step(q, k, v, g, beta, state):
    """One recurrence step per sequence; q, k, g [N, H, K], v [N, H, V], beta [N, H]; updates state [N, H, K, V]."""
    state.mul_(g.exp()[..., None])
    u = v - torch.einsum("nhk,nhkv->nhv", k, state)
    state.add_(k[..., None] * (beta[..., None] * u)[..., None, :])
    return torch.einsum("nhk,nhkv->nhv", q, state)


def _chunked(q, k, v, g, beta, state, cu):
    """Chunked scan over packed tokens: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [N, H, K, V] in/out."""
    T, H, K = q.shape
    V = v.shape[-1]
    lengths = cu[1:] - cu[:-1]
    max_len = int(lengths.max()) if lengths.numel() else 0
    if max_len == 0:
        return q.new_zeros(T, H, V)
    C = min(CHUNK, -(-max_len // _SUB) * _SUB)
    N = lengths.numel()
    n_chunks = -(-lengths // C)  # [N]
    NC = int(n_chunks.sum())
    # Step-major chunk layout: the chunks of step s (the s-th chunk of each sequence that has one) are
    # contiguous, sequences ranked by chunk count (descending), so step s uses ranks [0, n_active[s]).
    order = torch.argsort(n_chunks, descending=True, stable=True)  # rank -> sequence
    rank = torch.empty_like(order)
    rank[order] = torch.arange(N, device=q.device)
    steps = torch.arange(int(n_chunks.max()), device=q.device)
    n_active = (n_chunks[None, :] > steps[:, None]).sum(1)  # [steps]
    step_start = torch.cumsum(n_active, 0) - n_active
    if N == 1 and max_len % C == 0:
        dest = None  # the packed layout already is the chunk layout
    else:  # row of each token in the zero-padded chunk layout [NC * C]
        seq = torch.repeat_interleave(torch.arange(N, device=q.device), lengths)
        local = torch.arange(T, device=q.device) - cu[:-1][seq]
        dest = (step_start[local // C] + rank[seq]) * C + local % C

    def to_chunks(x):  # [T, H, D] -> [NC, H, C, D], zero rows for padding
        if dest is not None:
            x = x.new_zeros(NC * C, *x.shape[1:]).index_copy_(0, dest, x)
        return x.view(NC, C, *x.shape[1:]).transpose(1, 2).contiguous()

    qc, kc, vc, G = to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g).cumsum_(2)
    bc = to_chunks(beta[..., None])  # [NC, H, C, 1]
    A, P = _intra_chunk(qc, kc, G)
    M = A.mul_(bc)
    M.diagonal(dim1=-2, dim2=-1).fill_(1.0)  # I + diag(beta) A, unit lower triangular
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    M_inv = torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    eG = G.exp()
    U = M_inv @ (bc * vc)  # [NC, H, C, V]
    W = M_inv @ (bc * eG * kc)  # [NC, H, C, K]
    G_last = G[:, :, -1:, :]  # [NC, H, 1, K]
    Q_state = eG.mul_(qc).sub_(P @ W)  # [NC, H, C, K]
    K_state = ((G_last - G).exp_().mul_(kc)).transpose(-1, -2)  # [NC, H, K, C]
    decay_last = G_last.exp().transpose(-1, -2)  # [NC, H, K, 1]
    O = P @ U
    S_in = torch.empty(NC, H, K, V, dtype=torch.float32, device=q.device)
    ranked = state[order]  # [N, H, K, V], rank order
    for start, n in zip(step_start.tolist(), n_active.tolist()):
        step = slice(start, start + n)
        S0 = ranked[:n]
        S_in[step] = S0
        delta = torch.baddbmm(U[step].view(-1, C, V), W[step].view(-1, C, K), S0.view(-1, K, V), alpha=-1.0)
        S0.mul_(decay_last[step]).add_(K_state[step] @ delta.view(n, H, C, V))
    state[order] = ranked
    O += Q_state @ S_in
    o = O.transpose(1, 2).reshape(NC * C, H, V)
    return o if dest is None else o.index_select(0, dest)


def _intra_chunk(qc, kc, G):
    """A (strictly lower) and P (lower incl. diagonal), both [NC, H, C, C], from q, k, G [NC, H, C, K]."""
    NC, H, C, K = kc.shape
    A = kc.new_zeros(NC, H, C, C)
    P = kc.new_zeros(NC, H, C, C)
    mid = _SUB // 2
    Gb = G.view(NC, H, C // _SUB, _SUB, K)
    D = Gb - Gb[:, :, :, mid : mid + 1, :]  # [NC, H, nb, SUB, K]: exponents relative to each block's middle
    factored = float(D.abs().amax()) <= _MAX_MID_EXPONENT
    lower = torch.ones(_SUB, _SUB, dtype=torch.bool, device=kc.device).tril()
    for b, r in enumerate(range(0, C, _SUB)):
        blk = slice(r, r + _SUB)
        q_b, k_b, G_b = qc[:, :, blk], kc[:, :, blk], G[:, :, blk]  # [NC, H, SUB, K]
        if factored:
            eD = D[:, :, b].exp()
            kd = (k_b / eD).transpose(-1, -2)  # k * exp(G_m - G_j), [NC, H, K, SUB]
            Ad = (k_b * eD) @ kd
            Pd = (q_b * eD) @ kd
        else:
            diff = G_b[..., :, None, :] - G_b[..., None, :, :]  # [NC, H, SUB, SUB, K]
            decay = diff.masked_fill_(~lower[..., None], float("-inf")).exp_().mul_(k_b[..., None, :, :])
            Ad = (decay * k_b[..., :, None, :]).sum(-1)
            Pd = (decay * q_b[..., :, None, :]).sum(-1)
        A[:, :, blk, blk] = Ad.masked_fill_(~lower.tril(-1), 0.0)
        P[:, :, blk, blk] = Pd.masked_fill_(~lower, 0.0)
        if r == 0:
            continue
        # Earlier tokens j < r, through the block's first token r: both factors <= 1.
        G_r = G[:, :, r : r + 1]
        row = (G_b - G_r).exp_()  # [NC, H, SUB, K]
        col = (G_r - G[:, :, :r]).exp_().mul_(kc[:, :, :r]).transpose(-1, -2)  # [NC, H, K, r]
        A[:, :, blk, :r] = (k_b * row) @ col
        P[:, :, blk, :r] = (q_b * row) @ col
    return A, P

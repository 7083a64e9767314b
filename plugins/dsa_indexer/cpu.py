"""Fast CPU DSAIndexer (semantics in `reference.py`).

Per sequence, its keys 0..(last position) are gathered once through the block table (the step's own keys from
`k_new`; fp32 after the gather, fp8 pools decoded), then the chunk's queries score them with one matmul ([c*Hi, Di] x [Di, Lq]), relu,
and a batched head-weighted sum ([c, 1, Hi] x [c, Hi, Lq]); non-causal positions get -inf; `select_topk` then
picks the best `topk` with a stable descending sort (ties -> lower position), so the result is deterministic
and identical to ONNX TopK. Chunks keep the [c, Hi, Lq] temporary near `_CHUNK_ELEMS` floats.
"""

import torch

from ..sparse_mla_attention.reference import gather_context

_CHUNK_ELEMS = 1 << 24


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, L] (-inf = not a candidate) -> [T, topk] int64 positions, best first, ties to the lower
    position, -1 where fewer than topk candidates."""
    num_tokens, length = scores.shape
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    keep = min(topk, length)
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=scores.device)
    out[:, :keep] = torch.where(torch.isneginf(values[:, :keep]), -1, order[:, :keep])
    return out


def dsa_indexer_cpu(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    k_pool: torch.Tensor,
    k_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    topk: int,
) -> torch.Tensor:
    """q_idx [T, Hi, Di], weights [T, Hi], k_pool [NB, BS, Di], k_new [T, Di], cu_seqlens [N+1],
    block_tables [N, B], positions [T] -> indices [T, topk] int64."""
    num_tokens, num_heads, _ = q_idx.shape
    q = q_idx.float()
    w = weights.float()
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for n in range(cu_seqlens.shape[0] - 1):
        b, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if e == b:
            continue
        length = int(positions[b:e].max()) + 1
        keys = gather_context(k_pool, k_new, cu_seqlens, block_tables, positions, torch.tensor(n), torch.arange(length))
        keys_t = keys.T  # [Di, Lq]
        chunk = max(1, _CHUNK_ELEMS // max(1, length * num_heads))
        for t0 in range(b, e, chunk):
            t1 = min(e, t0 + chunk)
            per_head = torch.relu_(torch.matmul(q[t0:t1], keys_t))  # [c, Hi, Lq]
            score = torch.bmm(w[t0:t1, None, :], per_head)[:, 0]  # [c, Lq]
            score.masked_fill_(torch.arange(length)[None, :] > positions[t0:t1, None], float("-inf"))
            out[t0:t1] = select_topk(score, topk)
    return out

"""Fast CPU DSAIndexer (semantics in `reference.py`).

Per sequence, its keys 0..(last position) are gathered once through the block table (the step's own keys from
`k_new`; fp32 after the gather, fp8 pools decoded), then each chunk of the sequence's queries scores them tile by tile (a matmul per tile, relu, a batched head-weighted
sum [c, 1, Hi] x [c, Hi, tile]) into its [c, Lq] scores; non-causal positions get -inf; `select_topk` then picks the
best `topk` without sorting the row (ties -> lower position), so the result is deterministic and identical to ONNX
TopK. Chunks and tiles keep the [c, Lq] scores and the [c, Hi, tile] temporary near `_CHUNK_ELEMS` floats.
"""

import torch

from ..sparse_mla_attention.reference import gather_context
from .inputs import indexer_inputs

_CHUNK_ELEMS = 1 << 24


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, L] (-inf = not a candidate) -> [T, topk] int64 positions, best first, ties to the lower
    position, -1 where fewer than topk candidates. Without a sort of the row: each score becomes one int64 key,
    its float bits made order-preserving in the high half and (2^32 - 1 - position) in the low half, so keys are
    distinct and `torch.topk` on them is exact and tie-free."""
    num_tokens, length = scores.shape
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 -> +0.0, which tie
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - torch.arange(length, device=scores.device))
    keep = min(topk, length)
    order = torch.topk(keys, keep, dim=-1).indices
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=scores.device)
    out[:, :keep] = torch.where(torch.isneginf(scores.gather(1, order)), -1, order)
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
    q, w, new, cu, tables, positions = indexer_inputs(q_idx, weights, k_new, cu_seqlens, block_tables, positions, topk)
    num_tokens, num_heads, _ = q.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for n in range(cu.shape[0] - 1):
        b, e = int(cu[n]), int(cu[n + 1])
        if e == b:
            continue
        length = int(positions[b:e].max()) + 1
        keys = gather_context(k_pool, new, cu, tables, positions, torch.tensor(n), torch.arange(length))
        chunk = max(1, min(e - b, _CHUNK_ELEMS // length))
        tile = max(1, _CHUNK_ELEMS // (chunk * num_heads))
        for t0 in range(b, e, chunk):
            t1 = min(e, t0 + chunk)
            score = torch.empty(t1 - t0, length)
            for k0 in range(0, length, tile):
                k1 = min(length, k0 + tile)
                per_head = torch.relu_(torch.matmul(q[t0:t1], keys[k0:k1].T))  # [c, Hi, tile]
                score[:, k0:k1] = torch.bmm(w[t0:t1, None, :], per_head)[:, 0]
            score.masked_fill_(torch.arange(length)[None, :] > positions[t0:t1, None], float("-inf"))
            out[t0:t1] = select_topk(score, topk)
    return out

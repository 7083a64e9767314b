"""Fast CPU DSAIndexer (semantics in `reference.py`), streaming over the keys as the ONNX Runtime body does.

Per sequence, in chunks of its query tokens: its whole pool blocks before the chunk in tiles of whole blocks (one
gather of the tile's blocks through the block table, fp32 after the gather, fp8 pools decoded; no copy of the
context), then the rest (the pool rows of the block holding the chunk's start and the chunk's own keys from `k_new`)
under the causal mask. Each tile is scored with a matmul per tile, relu, and a batched head-weighted sum
[c, 1, Hi] x [c, Hi, tile], and merged into a running top-k of order keys (`order_keys`: score and position in one
distinct int64), so the selection is exact and deterministic (ties -> lower position, as ONNX TopK) without sorting a
row. Temporaries stay near `_CHUNK_ELEMS` floats, a tile at most `_TILE_POSITIONS` positions, whatever the context.
"""

import torch

from moe_export.quantize import fp8_cache

from .inputs import indexer_inputs

_CHUNK_ELEMS = 1 << 24
_TILE_POSITIONS = 1 << 14  # a decode step's tile of keys stays cache-sized (16k x Di fp32)
_LOW = 1 << 32
_NONE = _LOW - 1  # the position of an empty running entry: its key's low half is 0, below every real position's


def order_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores [..., X] fp32, positions [..., X] (or broadcast; < 2^32 - 1, or _NONE) -> int64 keys [..., X] ordered
    as (score descending, position ascending): the score's float bits made order-preserving in the high half,
    (2^32 - 1 - position) in the low half. Keys of distinct positions are distinct, so `torch.topk` on them is
    exact and tie-free."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 -> +0.0, which tie
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    return ordered.bitwise_left_shift_(32).add_(_NONE - positions)


def key_positions(keys: torch.Tensor) -> torch.Tensor:
    """int64 order keys -> their positions; -1 where the score was -inf (not a candidate) or the entry empty."""
    none = order_keys(torch.tensor([float("-inf")]), torch.tensor([_NONE]))
    return torch.where(keys.bitwise_right_shift(32) == int(none) >> 32, -1, _NONE - keys.bitwise_and(_NONE))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, L] (-inf = not a candidate) -> [T, topk] int64 positions, best first, ties to the lower
    position, -1 where fewer than topk candidates. Without a sort of the row (`order_keys`, `torch.topk`)."""
    num_tokens, length = scores.shape
    keep = min(topk, length)
    best = torch.topk(order_keys(scores, torch.arange(length, device=scores.device)), keep, dim=-1).values
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=scores.device)
    out[:, :keep] = key_positions(best)
    return out


def _rows(k_pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """fp32 key rows [len(blocks) x BS, Di] of pool blocks `blocks` (fp8 pools decoded)."""
    rows = torch.index_select(k_pool, 0, blocks).flatten(0, 1)  # (advanced indexing is ~6x slower here)
    return fp8_cache.decode_rows(rows) if k_pool.dtype == torch.uint8 else rows.float()


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
    block_tables [N, B], positions [T] (each sequence's tokens at consecutive positions) -> indices [T, topk] int64."""
    q, w, new, cu, tables, positions = indexer_inputs(q_idx, weights, k_new, cu_seqlens, block_tables, positions, topk)
    num_tokens, num_heads, _ = q.shape
    block_size = k_pool.shape[1]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for n in range(cu.shape[0] - 1):
        b, e = int(cu[n]), int(cu[n + 1])
        if e == b:
            continue
        start = int(positions[b])
        full = start // block_size  # whole pool blocks before the chunk: every token of it reads them all
        table = tables[n]
        tail = torch.cat([_rows(k_pool, table[full:full + 1].clamp(min=0))[: start - full * block_size],
                          new[b:e]])  # positions full*BS .. start+Tn-1
        tail_pos = torch.arange(full * block_size, start + e - b)
        widest = max(min(_TILE_POSITIONS, full * block_size), tail_pos.shape[0])  # key columns scored at once
        chunk = max(1, min(e - b, _CHUNK_ELEMS // (num_heads * widest)))
        for t0 in range(b, e, chunk):
            t1 = min(e, t0 + chunk)
            qc, wc = q[t0:t1], w[t0:t1, None, :]

            def scored(keys: torch.Tensor, qc=qc, wc=wc) -> torch.Tensor:
                return torch.bmm(wc, torch.relu_(torch.matmul(qc, keys.T)))[:, 0]  # [c, X]

            best = order_keys(torch.full((t1 - t0, topk), float("-inf")), torch.tensor(_NONE))
            per_tile = max(1, min(_TILE_POSITIONS, _CHUNK_ELEMS // ((t1 - t0) * num_heads)) // block_size)
            for j0 in range(0, full, per_tile):
                j1 = min(full, j0 + per_tile)
                keys = order_keys(scored(_rows(k_pool, table[j0:j1].clamp(min=0))),
                                  torch.arange(j0 * block_size, j1 * block_size))
                best = torch.topk(torch.cat([best, keys], 1), topk, dim=1).values
            score = scored(tail).masked_fill_(tail_pos[None, :] > positions[t0:t1, None], float("-inf"))
            best = torch.topk(torch.cat([best, order_keys(score, tail_pos)], 1), topk, dim=1).values
            out[t0:t1] = key_positions(best)
    return out

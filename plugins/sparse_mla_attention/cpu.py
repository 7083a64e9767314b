"""Fast CPU SparseMLAAttention (semantics in `reference.py`).

Sparse path: gathers only the K selected latent rows per token (cost independent of the context length) and
runs two batched matmuls per token chunk. Dense path (no indices): per sequence, one matmul of the chunk's
queries against the slot's cache prefix with a causal mask. Chunks keep temporaries near `_CHUNK_ELEMS` floats.
"""

import torch

from .reference import token_slots

_CHUNK_ELEMS = 1 << 24


def masked_softmax_combine(scores: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis restricted to `valid`, then the probability-weighted sum of `values`.

    scores [B, H, K] fp32 (already scaled), valid [B, 1 or H, K] bool, values [B, K, Dc] or [K, Dc] shared by
    the batch -> [B, H, Dc]; rows with no valid entry give zeros.
    """
    scores = scores.masked_fill(~valid, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.matmul(probs, values)


def _sparse(q, kv_cache, slots, positions, topk_indices, scale, kv_lora_rank):
    num_tokens, num_heads, dim = q.shape
    num_slots, max_len, _ = kv_cache.shape
    k = topk_indices.shape[1]
    flat = kv_cache.reshape(num_slots * max_len, dim)
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32)
    chunk = max(1, _CHUNK_ELEMS // max(1, k * max(dim, num_heads)))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        idx = topk_indices[t0:t1]
        valid = (idx >= 0) & (idx <= positions[t0:t1, None])
        rows = slots[t0:t1, None] * max_len + idx.clamp(0, max_len - 1)
        gathered = flat.index_select(0, rows.reshape(-1)).view(t1 - t0, k, dim).float()
        scores = torch.bmm(q[t0:t1], gathered.transpose(1, 2)).mul_(scale)
        out[t0:t1] = masked_softmax_combine(scores, valid[:, None, :], gathered[:, :, :kv_lora_rank])
    return out


def _dense(q, kv_cache, cu_seqlens, slot_ids, positions, scale, kv_lora_rank):
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32)
    for n in range(slot_ids.shape[0]):
        b, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if e == b:
            continue
        length = int(positions[b:e].max()) + 1
        keys = kv_cache[int(slot_ids[n]), :length].float()  # [Lq, Dc+Dr]
        chunk = max(1, _CHUNK_ELEMS // max(1, length * num_heads))
        for t0 in range(b, e, chunk):
            t1 = min(e, t0 + chunk)
            scores = torch.matmul(q[t0:t1], keys.T).mul_(scale)  # [c, H, Lq]
            valid = torch.arange(length)[None, None, :] <= positions[t0:t1, None, None]
            out[t0:t1] = masked_softmax_combine(scores, valid, keys[:, :kv_lora_rank])
    return out


def sparse_mla_attention_cpu(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    topk_indices: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """q_lat [T, H, Dc+Dr], kv_cache [S, L, Dc+Dr], cu_seqlens [N+1], slot_ids [N], positions [T],
    topk_indices [T, K] or None (None or K = 0: dense causal) -> o_lat [T, H, Dc] fp32."""
    q = q_lat.float()
    if topk_indices is None or topk_indices.shape[1] == 0:
        return _dense(q, kv_cache, cu_seqlens, slot_ids, positions, scale, kv_lora_rank)
    slots = token_slots(cu_seqlens, slot_ids, q.shape[0])
    return _sparse(q, kv_cache, slots, positions, topk_indices, scale, kv_lora_rank)

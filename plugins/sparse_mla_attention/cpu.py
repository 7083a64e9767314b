"""Fast CPU SparseMLAAttention (semantics in `reference.py`).

Sparse path: gathers only the K selected latent rows per token through the block tables (cost independent of
the context length and of the pool size) and runs two batched matmuls per token chunk. Dense path (no indices):
per sequence, gathers its rows 0..(last position) once and streams each chunk of its queries over tiles of them
(online softmax, causal mask). Rows are cast (fp8 pools: decoded) to fp32 after the gather. Chunks and tiles keep
temporaries near `_CHUNK_ELEMS` floats.
"""

import torch

from .inputs import attention_inputs, token_sequences
from .reference import gather_context

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


def _sparse(q, ctx, seqs, positions, topk_indices, scale, kv_lora_rank):
    num_tokens, num_heads, dim = q.shape
    k = topk_indices.shape[1]
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32)
    chunk = max(1, _CHUNK_ELEMS // max(1, k * max(dim, num_heads)))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        idx = topk_indices[t0:t1]
        valid = (idx >= 0) & (idx <= positions[t0:t1, None])
        gathered = gather_context(*ctx, seqs[t0:t1], idx.clamp(min=0))  # [c, K, Dc+Dr] fp32
        gathered = torch.where(valid[..., None], gathered, 0.0)
        scores = torch.bmm(q[t0:t1], gathered.transpose(1, 2)).mul_(scale)
        out[t0:t1] = masked_softmax_combine(scores, valid[:, None, :], gathered[:, :, :kv_lora_rank])
    return out


def _dense(q, ctx, cu_seqlens, positions, scale, kv_lora_rank):
    """Per sequence and chunk of its tokens, an online softmax over tiles of its keys: running max, denominator and
    weighted sum, rescaled per tile; temporaries near `_CHUNK_ELEMS` floats at any context."""
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32)
    for n in range(cu_seqlens.shape[0] - 1):
        b, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if e == b:
            continue
        length = int(positions[b:e].max()) + 1
        keys = gather_context(*ctx, torch.tensor(n), torch.arange(length))  # [Lq, Dc+Dr] fp32
        chunk = max(1, min(e - b, _CHUNK_ELEMS // max(1, length * num_heads)))
        tile = max(1, _CHUNK_ELEMS // (chunk * num_heads))
        for t0 in range(b, e, chunk):
            t1 = min(e, t0 + chunk)
            m = torch.full((t1 - t0, num_heads, 1), float("-inf"))
            denom = torch.zeros(t1 - t0, num_heads, 1)
            acc = torch.zeros(t1 - t0, num_heads, kv_lora_rank)
            for k0 in range(0, int(positions[t1 - 1]) + 1, tile):
                k1 = min(length, k0 + tile)
                scores = torch.matmul(q[t0:t1], keys[k0:k1].T).mul_(scale)  # [c, H, tile]
                causal = torch.arange(k0, k1)[None, None, :] <= positions[t0:t1, None, None]
                scores.masked_fill_(~causal, float("-inf"))
                m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))  # finite: position k0 <= every token's
                probs = torch.exp(scores - m_new)
                corr = torch.exp(m - m_new)
                denom = denom * corr + probs.sum(dim=-1, keepdim=True)
                acc = acc * corr + torch.matmul(probs, keys[k0:k1, :kv_lora_rank])
                m = m_new
            out[t0:t1] = acc / denom
    return out


def sparse_mla_attention_cpu(
    q_lat: torch.Tensor,
    kv_pool: torch.Tensor,
    kv_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    topk_indices: torch.Tensor | None = None,
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """q_lat [T, H, Dc+Dr], kv_pool [NB, BS, Dc+Dr], kv_new [T, Dc+Dr], cu_seqlens [N+1], block_tables [N, B],
    positions [T], topk_indices [T, K] or None (None or K = 0: dense causal) -> o_lat [T, H, Dc] fp32."""
    q, new, cu, tables, positions, idx = attention_inputs(q_lat, kv_pool, kv_new, cu_seqlens, block_tables, positions,
                                                          topk_indices, kv_lora_rank)
    ctx = (kv_pool, new, cu, tables, positions)
    if idx is None:
        return _dense(q, ctx, cu, positions, scale, kv_lora_rank)
    return _sparse(q, ctx, token_sequences(cu, q.shape[0]), positions, idx, scale, kv_lora_rank)

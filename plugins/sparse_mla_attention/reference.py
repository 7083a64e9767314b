"""Naive fp32 reference of SparseMLAAttention: absorbed MLA over a paged latent cache, restricted to top-k rows.

Layout shared by every implementation of this op (and by DSAIndexer):

- The cache pool `kv_pool` [NB, BS, Dc+Dr] holds NB blocks of BS token rows `[c (Dc = kv_lora_rank) | k_pe (Dr)]`,
  stored in any float dtype (fp32, bf16, fp16) or as fp8: a uint8 pool [NB, BS, Dc+Dr+1] of E4M3 codes and one
  E8M0 scale byte per row (`moe_export.quantize.fp8_cache`). Rows are gathered first and cast (or decoded) to fp32
  after, so the cost follows the rows used, never the pool size. Sequence n's position p lives in block `block_tables[n, p // BS]`,
  row `p % BS`; `block_tables` [N, B] lists each sequence's blocks in order (-1 = unused tail).
- Query tokens of N sequences are packed along T: sequence n owns tokens `cu_seqlens[n] : cu_seqlens[n+1]`;
  `positions[t]` is the absolute position of token t in its sequence, consecutive within a sequence. Sequence
  n's chunk starts at `start_n = positions[cu_seqlens[n]]`.
- `kv_new` [T, Dc+Dr] fp32 holds the rows of this step's tokens (not yet in the pool: the runtime writes them
  after the step; the graph rounds them to the pool's dtype first, so the step sees what later steps will). Position p of sequence n reads `kv_new[cu_seqlens[n] + p - start_n]` when p >= start_n (the step's
  own tokens) and the pool otherwise (earlier steps).
- Token t may attend to positions `0..positions[t]` of its sequence (causal). With `topk_indices` [T, K] it
  attends only to the listed positions; entries that are negative (−1 = padding) or beyond `positions[t]` are
  ignored. Every listed position counts once per occurrence (indices are expected to be distinct, as the indexer
  gives). Without `topk_indices`, or with K = 0 columns, attention is dense causal (the K = 0 form exists because
  TensorRT plugins have fixed input lists; see `tensorrt_plugin.py`).
- `score_s = (q_lat[t,h] · row_s) * scale`, `p = softmax over the attended s`, `o_lat[t,h] = Σ_s p_s · row_s[:Dc]`.
  A token with nothing to attend to gets zeros.
"""

import torch

from moe_export.quantize import fp8_cache

from .inputs import attention_inputs, token_sequences


def gather_context(
    kv_pool: torch.Tensor,
    kv_new: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    seq: torch.Tensor,
    idx: torch.Tensor,
) -> torch.Tensor:
    """fp32 rows at positions `idx` [..., K] of sequences `seq` [...] (broadcast over K): from `kv_new` for the
    step's own positions, else through the block table from `kv_pool`. Positions outside 0..(chunk end) give
    an arbitrary row (callers mask them). Returns [..., K, D]."""
    num_blocks, block_size, width = kv_pool.shape
    first = cu_seqlens[seq].unsqueeze(-1)  # [..., 1] first token of the sequence in the step
    start = positions[cu_seqlens[seq].clamp(max=positions.shape[0] - 1)].unsqueeze(-1)  # chunk start position
    own = idx >= start
    new_row = (first + idx - start).clamp(0, max(kv_new.shape[0] - 1, 0))
    block_col = (idx // block_size).clamp(0, block_tables.shape[1] - 1)
    block = block_tables[seq.unsqueeze(-1).expand_as(idx), block_col].clamp(0, num_blocks - 1)
    pool_row = block * block_size + idx.remainder(block_size)
    from_pool = kv_pool.reshape(num_blocks * block_size, width)[pool_row.reshape(-1)]
    from_pool = fp8_cache.decode_rows(from_pool) if kv_pool.dtype == torch.uint8 else from_pool.float()
    from_new = kv_new[new_row.reshape(-1)].float()
    rows = torch.where(own.reshape(-1, 1), from_new, from_pool)
    return rows.view(*idx.shape, from_pool.shape[-1])


def sparse_mla_attention_reference(
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
    """One query token at a time, in fp32.

    q_lat [T, H, Dc+Dr], kv_pool [NB, BS, Dc+Dr], kv_new [T, Dc+Dr], cu_seqlens [N+1], block_tables [N, B],
    positions [T] (int64), topk_indices [T, K] int64 or None (None or K = 0: dense causal)
    -> o_lat [T, H, Dc] fp32, Dc = kv_lora_rank.
    """
    q, new, cu, tables, positions, topk_indices = attention_inputs(q_lat, kv_pool, kv_new, cu_seqlens, block_tables,
                                                                   positions, topk_indices, kv_lora_rank)
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    seqs = token_sequences(cu, num_tokens)
    for t in range(num_tokens):
        pos = int(positions[t])
        if topk_indices is None:
            selected = torch.arange(pos + 1, device=q.device)
        else:
            idx = topk_indices[t]
            selected = idx[(idx >= 0) & (idx <= pos)]
        if selected.numel() == 0:
            continue
        rows = gather_context(kv_pool, new, cu, tables, positions, seqs[t], selected)
        scores = (q[t] @ rows.T) * scale  # [H, n]
        probs = torch.softmax(scores, dim=-1)
        out[t] = probs @ rows[:, :kv_lora_rank]
    return out

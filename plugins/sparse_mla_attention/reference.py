"""Naive fp32 reference of SparseMLAAttention: absorbed MLA over a latent cache, restricted to top-k rows.

Layout shared by every implementation of this op (and by DSAIndexer):

- The cache pool `kv_cache` [S, L, Dc+Dr] holds per slot (one sequence each) and per absolute position the
  latent row `[c (Dc = kv_lora_rank) | k_pe (Dr)]`; it already contains the rows of this step's tokens.
- Query tokens of N sequences are packed along T: sequence n owns tokens `cu_seqlens[n] : cu_seqlens[n+1]`
  and lives in cache slot `slot_ids[n]`; `positions[t]` is the absolute position of token t in its sequence.
- Token t may attend to cache rows `0..positions[t]` of its slot (causal). With `topk_indices` [T, K] it attends
  only to the listed positions; entries that are negative (−1 = padding) or beyond `positions[t]` are ignored.
  Every listed position counts once per occurrence (indices are expected to be distinct, as the indexer gives).
  Without `topk_indices`, or with K = 0 columns, attention is dense causal (the K = 0 form exists because
  TensorRT plugins have fixed input lists; see `tensorrt_plugin.py`).
- `score_s = (q_lat[t,h] · kv_cache[slot, s]) * scale`, `p = softmax over the attended s`,
  `o_lat[t,h] = Σ_s p_s · kv_cache[slot, s, :Dc]`. A token with nothing to attend to gets zeros.
"""

import torch


def token_slots(cu_seqlens: torch.Tensor, slot_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Cache slot of each packed query token.

    cu_seqlens [N+1] int64 (cumulative query-token counts), slot_ids [N] int64 -> [T] int64.
    """
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return slot_ids[seq]


def sparse_mla_attention_reference(
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
    """One query token at a time, in fp32.

    q_lat [T, H, Dc+Dr], kv_cache [S, L, Dc+Dr], cu_seqlens [N+1], slot_ids [N], positions [T] (int64),
    topk_indices [T, K] int64 or None (None or K = 0: dense causal) -> o_lat [T, H, Dc] fp32, Dc = kv_lora_rank.
    """
    if topk_indices is not None and topk_indices.shape[1] == 0:
        topk_indices = None
    num_tokens, num_heads, _ = q_lat.shape
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q_lat.device)
    slots = token_slots(cu_seqlens, slot_ids, num_tokens)
    for t in range(num_tokens):
        pos = int(positions[t])
        if topk_indices is None:
            selected = torch.arange(pos + 1, device=q_lat.device)
        else:
            idx = topk_indices[t]
            selected = idx[(idx >= 0) & (idx <= pos)]
        if selected.numel() == 0:
            continue
        rows = kv_cache[slots[t], selected].float()  # [n, Dc+Dr]
        scores = (q_lat[t].float() @ rows.T) * scale  # [H, n]
        probs = torch.softmax(scores, dim=-1)
        out[t] = probs @ rows[:, :kv_lora_rank]
    return out

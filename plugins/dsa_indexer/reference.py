"""Naive fp32 reference of DSAIndexer, the DeepSeek-V3.2 lightning indexer (top-k selection for sparse MLA).

Per query token t (at absolute position `pos = positions[t]` of its sequence) and position s <= pos:
            score[t, s] = Σ_h relu(q_idx[t, h] · key[s]) * weights[t, h]
The output lists the `topk` positions of highest score, best first; ties go to the lower position (the rule of
ONNX TopK); when fewer than `topk` positions exist (pos + 1 < topk) the row is padded with -1.
Packing of tokens and sequences and the paged key cache (pool `k_pool` [NB, BS, Di] read through `block_tables`
for earlier steps, `k_new` [T, Di] for the step's own positions, any float storage dtype cast to fp32 after the
gather) are those of SparseMLAAttention (`sparse_mla_attention/reference.py`).

Op boundary w.r.t. transformers' `DeepseekV32Indexer.forward` (projections, norm and rope stay in the graph):
  q_idx   = rope(wq_b(q_resid).view(T, Hi, Di))     rope on the first qk_rope_head_dim dims, half-split layout
  k       = rope(k_norm(wk(x)))                      k_norm is a LayerNorm (eps 1e-6); k is this step's k_new
  weights = weights_proj(x) * Hi**-0.5 * Di**-0.5    HF's softmax_scale = Di**-0.5 multiplies q·k *inside* the
                                                     relu; relu(a*c) = c*relu(a) for c > 0, so it is folded here
HF's Hadamard rotation / FP8 scoring of the original release are orthogonal / precision-only and not modelled.
A NoPE model (K3-style MLA) simply skips the rope.

GLM-5-Next "shared" layers (`Glm5NextConfig.indexer_types[i] == "shared"`, also set from `index_topk_pattern`
or `index_topk_freq` / `index_skip_topk_offset`) run no indexer: their SparseMLAAttention node consumes the
`indices` value produced by the previous "full" layer's DSAIndexer node (the graph wires the same tensor to
both attention nodes; nothing is recomputed). GLM-5-Next's own indexer additionally pools keys in groups of
`index_kpool` and appends the visible tail; that pooled variant is a different op and is not implemented here.
"""

import torch

from ..sparse_mla_attention.inputs import token_sequences
from ..sparse_mla_attention.reference import gather_context
from .inputs import indexer_inputs


def dsa_indexer_reference(
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
    """One token at a time, in fp32.

    q_idx [T, Hi, Di], weights [T, Hi], k_pool [NB, BS, Di], k_new [T, Di], cu_seqlens [N+1], block_tables [N, B],
    positions [T] -> indices [T, topk] int64 (positions within the sequence, best first, -1 padding).
    """
    q, w, new, cu, tables, positions = indexer_inputs(q_idx, weights, k_new, cu_seqlens, block_tables, positions, topk)
    num_tokens = q.shape[0]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int64, device=q.device)
    seqs = token_sequences(cu, num_tokens)
    for t in range(num_tokens):
        pos = int(positions[t])
        keys = gather_context(k_pool, new, cu, tables, positions, seqs[t],
                              torch.arange(pos + 1, device=q.device))  # [pos+1, Di] fp32
        per_head = torch.relu(q[t] @ keys.T)  # [Hi, pos+1]
        score = w[t] @ per_head  # [pos+1]
        order = torch.sort(score, descending=True, stable=True).indices[:topk]
        out[t, : order.numel()] = order
    return out

"""The input preparation every DSAIndexer implementation (reference, cpu, triton) runs: shapes checked (host
metadata only), float inputs fp32 contiguous, the step's indices int64 contiguous (`sparse_mla_attention.inputs`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sparse_mla_attention.inputs import step_indices


class IndexerInputs(NamedTuple):
    """q [T, Hi, Di], weights [T, Hi] and new [T, Di] fp32 contiguous; cu [N+1], tables [N, B], positions [T]
    int64 contiguous."""

    q: torch.Tensor
    weights: torch.Tensor
    new: torch.Tensor
    cu: torch.Tensor
    tables: torch.Tensor
    positions: torch.Tensor


def indexer_inputs(q_idx: torch.Tensor, weights: torch.Tensor, k_new: torch.Tensor, cu_seqlens: torch.Tensor,
                   block_tables: torch.Tensor, positions: torch.Tensor, topk: int) -> IndexerInputs:
    """Checks q_idx [T, Hi, Di], weights [T, Hi], k_new [T, Di] and topk >= 1; returns `IndexerInputs`."""
    op = "DSAIndexer"
    if q_idx.dim() != 3:
        raise ValueError(f"{op}: q_idx must be [T, Hi, Di], got {tuple(q_idx.shape)}")
    num_tokens, num_heads, dim = q_idx.shape
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"{op}: weights must be [T, Hi] = [{num_tokens}, {num_heads}], got {tuple(weights.shape)}")
    if k_new.shape != (num_tokens, dim):
        raise ValueError(f"{op}: k_new must be [T, Di] = [{num_tokens}, {dim}], got {tuple(k_new.shape)}")
    if topk < 1:
        raise ValueError(f"{op}: topk must be >= 1, got {topk}")
    steps = step_indices(cu_seqlens, block_tables, positions, num_tokens, op)
    return IndexerInputs(q_idx.float().contiguous(), weights.float().contiguous(), k_new.float().contiguous(), *steps)

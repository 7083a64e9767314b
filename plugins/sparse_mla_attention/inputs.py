"""The input preparation every SparseMLAAttention implementation (reference, cpu, triton) runs, and the step's
index inputs the paged-cache ops share (DSAIndexer, PagedCacheWrite): int64 contiguous cu_seqlens [N+1],
block_tables [N, B] and positions [T], fp32 contiguous float inputs. Shapes are checked (host metadata only: nothing
is read back from the device)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepIndices(NamedTuple):
    """A step's packing as int64 contiguous tensors: cu [N+1], tables [N, B], positions [T]."""

    cu: torch.Tensor
    tables: torch.Tensor
    positions: torch.Tensor


def step_indices(cu_seqlens: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                 num_tokens: int, op: str) -> StepIndices:
    """cu_seqlens [N+1], block_tables [N, B], positions [T] (any integer dtype) -> `StepIndices`; a ValueError
    naming `op` and the input when a shape is wrong."""
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{op}: cu_seqlens must be [N+1], got {tuple(cu_seqlens.shape)}")
    if block_tables.dim() != 2:
        raise ValueError(f"{op}: block_tables must be [N, B], got {tuple(block_tables.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"{op}: positions must be [T] = [{num_tokens}], got {tuple(positions.shape)}")
    return StepIndices(*(t.to(torch.int64).contiguous() for t in (cu_seqlens, block_tables, positions)))


def token_sequences(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence index of each packed token: cu_seqlens [N+1] int64 -> [T] int64."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)


class AttentionInputs(NamedTuple):
    """SparseMLAAttention's inputs as every implementation reads them: q [T, H, Dc+Dr] and new [T, Dc+Dr] fp32
    contiguous, the step's int64 indices, idx [T, K] int64 or None (dense causal: no indices, or K = 0)."""

    q: torch.Tensor
    new: torch.Tensor
    cu: torch.Tensor
    tables: torch.Tensor
    positions: torch.Tensor
    idx: torch.Tensor | None


def attention_inputs(q_lat: torch.Tensor, kv_pool: torch.Tensor, kv_new: torch.Tensor, cu_seqlens: torch.Tensor,
                     block_tables: torch.Tensor, positions: torch.Tensor, topk_indices: torch.Tensor | None,
                     kv_lora_rank: int) -> AttentionInputs:
    """Checks the shapes (q_lat [T, H, Dc+Dr], kv_new [T, Dc+Dr], the pool's rows Dc+Dr wide, or Dc+Dr+1 bytes for
    fp8, topk_indices [T, K]) and returns `AttentionInputs`."""
    op = "SparseMLAAttention"
    if q_lat.dim() != 3 or q_lat.shape[2] < kv_lora_rank:
        raise ValueError(f"{op}: q_lat must be [T, H, Dc+Dr] with Dc = kv_lora_rank = {kv_lora_rank}, got "
                         f"{tuple(q_lat.shape)}")
    num_tokens, _, dim = q_lat.shape
    if kv_new.shape != (num_tokens, dim):
        raise ValueError(f"{op}: kv_new must be [T, Dc+Dr] = [{num_tokens}, {dim}], got {tuple(kv_new.shape)}")
    width = dim + 1 if kv_pool.dtype == torch.uint8 else dim
    if kv_pool.dim() != 3 or kv_pool.shape[2] != width:
        raise ValueError(f"{op}: kv_pool must be [NB, BS, {width}] ({kv_pool.dtype}), got {tuple(kv_pool.shape)}")
    idx = None
    if topk_indices is not None and topk_indices.shape[-1] > 0:
        if topk_indices.dim() != 2 or topk_indices.shape[0] != num_tokens:
            raise ValueError(f"{op}: topk_indices must be [T, K] with T = {num_tokens}, got "
                             f"{tuple(topk_indices.shape)}")
        idx = topk_indices.to(torch.int64).contiguous()
    steps = step_indices(cu_seqlens, block_tables, positions, num_tokens, op)
    return AttentionInputs(q_lat.float().contiguous(), kv_new.float().contiguous(), *steps, idx)

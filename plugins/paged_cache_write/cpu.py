"""Fast CPU PagedCacheWrite (semantics in `reference.py`), in place: one gather of the tokens' physical rows and
one indexed store, O(tokens). This is the ONNX Runtime engine's write-back (`runtime/engine/ort.py`): ORT cannot alias
a graph output to an input, so its graphs return the new rows and the runtime stores them with this function."""

import torch

from ..sparse_mla_attention.reference import token_sequences
from .reference import stored_rows


def cache_rows(cu_seqlens: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] int64 physical pool row of each token: block_tables[seq, pos // BS] * BS + pos % BS."""
    seqs = token_sequences(cu_seqlens, positions.shape[0])
    return block_tables[seqs, positions // block_size] * block_size + positions % block_size


def paged_cache_write_(
    pool: torch.Tensor,
    new_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Write new_rows [T, D] fp32 into pool [NB, BS, W] in place (W = D, or D + 1 for a uint8 fp8 pool); returns
    the pool."""
    rows = cache_rows(cu_seqlens, block_tables, positions, pool.shape[1])
    pool.view(-1, pool.shape[-1])[rows] = stored_rows(pool, new_rows)
    return pool

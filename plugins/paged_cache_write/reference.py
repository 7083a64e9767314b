"""Naive reference of PagedCacheWrite: a step's new cache rows stored into a paged pool.

Layout as in SparseMLAAttention (`sparse_mla_attention/reference.py`): token t of the step belongs to sequence n
(`cu_seqlens[n] <= t < cu_seqlens[n+1]`) at absolute position p = `positions[t]`; its row lives in pool block
`block_tables[n, p // BS]`, row `p % BS`. The new rows [T, D] are fp32 values already rounded to the pool's
storage (the graph rounds them and attends over the rounded values in the same step); they are stored cast to
the pool dtype, or for a uint8 pool [NB, BS, D + 1] as fp8 rows with their scale byte
(`moe_export.quantize.fp8_cache.encode_rows`). Every other pool row is left as it was.

Tokens of one step write distinct rows (the runtime checks it before the step: `runtime.engine.batch.check_step_batch`).
"""

import torch

from moe_export.quantize import fp8_cache

from ..sparse_mla_attention.inputs import token_sequences
from .inputs import write_inputs


def stored_rows(pool: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
    """new_rows [T, D] fp32 in the pool's storage: cast, or fp8-encoded to [T, D + 1] uint8 for a uint8 pool."""
    return fp8_cache.encode_rows(new_rows) if pool.dtype == torch.uint8 else new_rows.to(pool.dtype)


def paged_cache_write_reference(
    pool: torch.Tensor,
    new_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token at a time: pool [NB, BS, W] (W = D, or D + 1 for fp8), new_rows [T, D] fp32, cu_seqlens [N+1],
    block_tables [N, B], positions [T] (int64) -> a copy of the pool with the rows written."""
    rows, cu, tables, positions = write_inputs(new_rows, cu_seqlens, block_tables, positions, pool)
    out = pool.clone()
    seqs = token_sequences(cu, rows.shape[0])
    block_size = pool.shape[1]
    for t in range(rows.shape[0]):
        pos = int(positions[t])
        block = int(tables[seqs[t], pos // block_size])
        out[block, pos % block_size] = stored_rows(pool, rows[t : t + 1])[0]
    return out

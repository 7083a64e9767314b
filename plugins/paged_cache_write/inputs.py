"""The input preparation every PagedCacheWrite implementation (reference, cpu, triton) runs: shapes checked (host
metadata only), the new rows fp32 contiguous, the step's indices int64 contiguous (`sparse_mla_attention.inputs`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sparse_mla_attention.inputs import step_indices


class WriteInputs(NamedTuple):
    """rows [T, D] fp32 contiguous; cu [N+1], tables [N, B], positions [T] int64 contiguous."""

    rows: torch.Tensor
    cu: torch.Tensor
    tables: torch.Tensor
    positions: torch.Tensor


def write_inputs(new_rows: torch.Tensor, cu_seqlens: torch.Tensor, block_tables: torch.Tensor,
                 positions: torch.Tensor, pool: torch.Tensor | None) -> WriteInputs:
    """Checks new_rows [T, D] (against `pool` [NB, BS, W] when the caller holds it: W = D, or D + 1 bytes for a
    uint8 fp8 pool; the TensorRT path reaches its pool through the table); returns `WriteInputs`."""
    op = "PagedCacheWrite"
    if new_rows.dim() != 2:
        raise ValueError(f"{op}: new_rows must be [T, D], got {tuple(new_rows.shape)}")
    if pool is not None:
        width = new_rows.shape[1] + (pool.dtype == torch.uint8)
        if pool.dim() != 3 or pool.shape[2] != width:
            raise ValueError(f"{op}: a {pool.dtype} pool for rows of D = {new_rows.shape[1]} must be "
                             f"[NB, BS, {width}], got {tuple(pool.shape)}")
    steps = step_indices(cu_seqlens, block_tables, positions, new_rows.shape[0], op)
    return WriteInputs(new_rows.float().contiguous(), *steps)

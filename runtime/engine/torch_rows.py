"""Raw bytes of rows of torch pools, for the offload store (`runtime.core.state_offload`): the torch runner's pools
and checkpoints and TensorRT's (CUDA pools, pinned host checkpoints). Any dtype (bf16, fp8 rows) travels as uint8."""

from __future__ import annotations

import numpy as np
import torch


def pool_layout(kind: str, pool: torch.Tensor) -> list:
    """[kind ("state" | "cache"), bytes of one row, dtype, row shape] of a pool [rows, ...]."""
    return [kind, pool[0].numel() * pool.element_size(), str(pool.dtype), list(pool.shape[1:])]


def read_row_bytes(pool: torch.Tensor, index) -> np.ndarray:
    """Row `index` (an int: [bytes]) or rows (a list: [n, bytes]) of `pool` as uint8 on the host (a synchronous copy,
    ordered after the work queued on the current stream)."""
    if isinstance(index, int):
        return pool[index].contiguous().reshape(1, -1).view(torch.uint8).cpu().numpy()[0]
    rows = pool[torch.as_tensor(index, device=pool.device)]
    return rows.contiguous().reshape(len(index), -1).view(torch.uint8).cpu().numpy()


def write_row_bytes(pool: torch.Tensor, index, data: np.ndarray) -> None:
    """Write `read_row_bytes`' bytes back into row(s) `index` of `pool`."""
    n = 1 if isinstance(index, int) else len(index)
    src = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)).to(pool.device)
    rows = src.view(pool.dtype).reshape(n, *pool.shape[1:])
    if isinstance(index, int):
        pool[index].copy_(rows[0])
    else:
        pool[torch.as_tensor(index, device=pool.device)] = rows

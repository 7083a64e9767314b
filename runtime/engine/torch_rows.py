"""Raw bytes of rows of torch pools, for the offload store (`runtime.core.state_offload`): the torch runner's pools
and checkpoints and TensorRT's (CUDA pools, pinned host checkpoints). Any dtype (bf16, fp8 rows) travels as uint8."""

from __future__ import annotations

import numpy as np
import torch

from moe_export.runtime.engine.batch import RESET_ON_NEW_SEQUENCE, check_blocks, check_checkpoint, check_slot


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


def write_row_bytes(pool: torch.Tensor, index, data) -> None:
    """Write `read_row_bytes`' bytes back into row(s) `index` of `pool` (`data`: [bytes], [n, bytes] or n [bytes] rows,
    gathered on the host for one copy to the device)."""
    n = 1 if isinstance(index, int) else len(index)
    src = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)).to(pool.device)
    rows = src.view(pool.dtype).reshape(n, *pool.shape[1:])
    if isinstance(index, int):
        pool[index].copy_(rows[0])
    else:
        pool[torch.as_tensor(index, device=pool.device)] = rows


class PoolRows:
    """`runner.OffloadRunner` over torch pools (the torch and TensorRT runners), rows keyed "{rank}/{pool}". A runner
    gives `rank_pools()` {rank: {pool name: pool [rows, ...]}}, `rank_checkpoints()` the same for its checkpoints,
    and `pool_stream(wait)`: a context on the stream its steps run on, entered after that stream's queued work when
    `wait` (a read follows the steps and checkpoint copies before it)."""

    def state_layout(self) -> dict[str, list]:
        return {f"{r}/{n}": pool_layout("state" if n.startswith(RESET_ON_NEW_SEQUENCE) else "cache", p)
                for r, pools in self.rank_pools().items() for n, p in pools.items()}

    def _rows(self, kind: str, index) -> dict[str, np.ndarray]:
        held = self.rank_checkpoints() if kind == "checkpoint" else self.rank_pools()
        with self.pool_stream(wait=True):
            return {f"{r}/{n}": read_row_bytes(p, index) for r, pools in held.items() for n, p in pools.items()
                    if n.startswith(RESET_ON_NEW_SEQUENCE) == (kind != "blocks")}

    def _write(self, kind: str, index, rows: dict[str, np.ndarray]) -> None:
        with self.pool_stream(wait=False):
            for r, pools in self.rank_pools().items():
                for n, p in pools.items():
                    if n.startswith(RESET_ON_NEW_SEQUENCE) == (kind == "slot"):
                        write_row_bytes(p, index, rows[f"{r}/{n}"])

    def read_slot(self, slot: int) -> dict[str, np.ndarray]:
        check_slot(self, slot)
        return self._rows("slot", slot)

    def read_checkpoint(self, checkpoint: int) -> dict[str, np.ndarray]:
        check_checkpoint(self, 0, checkpoint)
        return self._rows("checkpoint", checkpoint)

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        check_blocks(self, blocks)
        return self._rows("blocks", list(blocks))

    def write_slot(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        check_slot(self, slot)
        self._write("slot", slot, rows)

    def write_blocks(self, blocks: list[int], rows: dict) -> None:
        check_blocks(self, blocks)
        self._write("blocks", list(blocks), rows)

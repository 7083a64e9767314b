"""Runner infrastructure every multi-rank runner shares (ONNX Runtime, TensorRT, torch): the engine directory's
rank folders and the host-side MPI communicator (step plans broadcast, tp / ep collectives of numpy arrays, the dp
layout's group leaders and group sums, which `runtime/core/wide_ep.py` uses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from moe_export.common.errors import InputError
from moe_export.common.mapping import Mapping
from moe_export.common.mpi import mpi_group_comms


def rank_folders(engine_dir: Path) -> list[Path]:
    """`rank{N}/` folders indexed by N (rank10 after rank9, not after rank1); InputError unless they are
    exactly rank0 .. rank{R-1}."""
    found = {int(p.name[4:]): p for p in engine_dir.glob("rank*") if p.is_dir() and p.name[4:].isdigit()}
    if not found:
        raise InputError(f"{engine_dir}: no rank*/ folders")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise InputError(f"{engine_dir}: rank folders {[f'rank{n}' for n in missing[:8]]} are missing "
                         f"(found {len(found)} of rank0..rank{max(found)})")
    return [found[n] for n in range(len(found))]


class MPICommunicator:
    """Collectives over MPI sub-communicators of the tp and ep groups (groups of consecutive ranks). In the dp
    layout `broadcast` reaches this rank's attention group (its tp group, from the group's first rank), and
    `leaders` joins the groups' first ranks (world rank 0 first; None on the other ranks)."""

    def __init__(self, mapping: Mapping):
        from mpi4py import MPI

        self.world = MPI.COMM_WORLD
        self.groups = mpi_group_comms(mapping)
        self.dp_layout = mapping.all_to_all
        leader = self.dp_layout and mapping.tp_rank == 0
        leaders = self.world.Split(0 if leader else MPI.UNDEFINED, mapping.rank)
        self.leaders = None if leaders == MPI.COMM_NULL else leaders

    def all_reduce(self, x: np.ndarray, group: str) -> np.ndarray:
        from mpi4py import MPI

        out = np.empty_like(x)
        self.groups[group].Allreduce(np.ascontiguousarray(x), out, op=MPI.SUM)
        return out

    def all_gather(self, x: np.ndarray, group: str, axis: int) -> np.ndarray:
        parts = self.groups[group].allgather(np.ascontiguousarray(x))
        return np.concatenate(parts, axis=axis)

    def broadcast(self, obj):
        return (self.groups["tp"] if self.dp_layout else self.world).bcast(obj, root=0)

    def group_sum(self, x: np.ndarray) -> np.ndarray:
        """x summed over this rank's tp group, on the group's first rank (the others get their own x back)."""
        from mpi4py import MPI

        out = np.empty_like(x)
        self.groups["tp"].Reduce(np.ascontiguousarray(x), out, op=MPI.SUM, root=0)
        return out if self.groups["tp"].Get_rank() == 0 else x

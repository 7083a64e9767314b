"""Run under `mpiexec -n 4`: the torch runner's `DistributedWorld` (gloo, tp 2 x ep 2) answers all-reduces in both of
its groups, then the process ends as a follower rank's does, without destroying the groups itself (`common.mpi`
does it at exit, before the interpreter is torn down), the world and the tensors of its last collectives still held
(as a runner holds its pools and buffers to the end). Rank 0 prints the sums as one JSON line."""

from __future__ import annotations

import json

import torch
from mpi4py import MPI

from moe_export.common.mapping import Mapping
from moe_export.runtime.engine.torch_collectives import AllReduce, DistributedWorld


def main() -> tuple[DistributedWorld, list[torch.Tensor]]:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    world = DistributedWorld(Mapping(size, rank, 2, 2), torch.device("cpu"))
    sums = [world.answer(AllReduce(torch.full((1000,), float(rank + 1)), group), 0, [])
            for _ in range(10) for group in ("tp", "ep")]
    rows = MPI.COMM_WORLD.gather([s[0].item() for s in sums], root=0)
    if rank == 0:
        print(json.dumps(rows), flush=True)
    return world, sums


if __name__ == "__main__":
    HELD = main()

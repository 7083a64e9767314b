"""Run under `mpiexec -n 2`, each rank in its own network namespace and hostname (`test_rendezvous.py`): the torch
runner's `DistributedWorld` (gloo, ep 2) forms its groups and answers one all-reduce; each rank prints
{"rank", "host", "sum"}."""

from __future__ import annotations

import json
import socket

import torch
from mpi4py import MPI

from moe_export.common.mapping import Mapping
from moe_export.runtime.engine.torch_collectives import AllReduce, DistributedWorld


def main() -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    world = DistributedWorld(Mapping(size, rank, 1, size), torch.device("cpu"))
    total = world.answer(AllReduce(torch.tensor([float(rank + 1)]), "ep"), 0, [])
    print(json.dumps({"rank": rank, "host": socket.gethostname(), "sum": total.item()}), flush=True)
    world.dist.destroy_process_group()


if __name__ == "__main__":
    main()

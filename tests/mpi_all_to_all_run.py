"""Run under `mpiexec -n EP`: every rank makes every rank's tokens (seeded; rank 1 idle), runs MoEDispatch ->
its experts -> MoECombine with MPI (`all_to_all.mpi_*`) and with torch.distributed over gloo through the TensorRT
path's `nccl.Communicator`, and compares both with the in-process reference. Rank 0 prints one JSON line
{"mpi_max_err": ..., "torch_max_err": ..., "rows_received": [per rank]}."""

from __future__ import annotations

import json
import socket

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from moe_export.plugins.collectives import all_to_all
from moe_export.plugins.collectives.nccl import Communicator

EXPERTS, TOP_K, DIM = 8, 3, 6


def tokens(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    n = 0 if rank == 1 else 2 + 3 * rank
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)]) if n else np.zeros((0, TOP_K), np.int64)
    return rng.standard_normal((n, DIM)).astype(np.float32), ids.astype(np.int64), rng.random((n, TOP_K)).astype(np.float32)


def experts(x: np.ndarray, ids: np.ndarray, w: np.ndarray, rank: int, ep: int) -> np.ndarray:
    """This rank's experts: expert e scales by (e + 1) and adds e; weighted sum over the rank's choices."""
    per = EXPERTS // ep
    y = np.zeros_like(x)
    for j in range(ids.shape[1]):
        on = (ids[:, j] // per == rank)[:, None]
        y += np.where(on, w[:, j:j + 1] * (x * (ids[:, j:j + 1] + 1) + ids[:, j:j + 1]), 0.0).astype(np.float32)
    return y


def main() -> None:
    world = MPI.COMM_WORLD
    rank, ep = world.Get_rank(), world.Get_size()
    data = [tokens(r) for r in range(ep)]
    recv = all_to_all.reference_dispatch(*zip(*data), EXPERTS)
    ys = [experts(rx, ri, rw, r, ep) for r, (rx, ri, rw, _) in enumerate(recv)]
    want = all_to_all.reference_combine(ys, [lay for *_, lay in recv], [d[0].shape[0] for d in data])[rank]

    rx, ri, rw, lay = all_to_all.mpi_dispatch(world, *data[rank], EXPERTS)
    mpi_out = all_to_all.mpi_combine(world, experts(rx, ri, rw, rank, ep), lay, data[rank][0].shape[0])

    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep)
    comm = Communicator(dist.new_group(list(range(ep))), ep)
    tx, tids, tw = (torch.from_numpy(a) for a in data[rank])
    trx, tri, trw, tlay = comm.moe_dispatch(tx, tids, tw, EXPERTS)
    ty = torch.from_numpy(experts(trx.numpy(), tri.numpy(), trw.numpy(), rank, ep))
    torch_out = comm.moe_combine(ty, tlay, tx.shape[0]).numpy()
    dist.destroy_process_group()

    errs = world.gather((float(np.abs(mpi_out - want).max(initial=0.0)), float(np.abs(torch_out - want).max(initial=0.0)),
                         int(rx.shape[0]), mpi_out.shape == want.shape == torch_out.shape), root=0)
    if rank == 0:
        print(json.dumps({"mpi_max_err": max(e[0] for e in errs), "torch_max_err": max(e[1] for e in errs),
                          "rows_received": [e[2] for e in errs], "shapes_match": all(e[3] for e in errs)}))


if __name__ == "__main__":
    main()

"""Which MPI launcher started this process, if any (the one detection used by `build` and the engines), and the
communicators of a rank's groups (`world_comm`, `mpi_group_comms`, `torch_group_comms`).

Launchers announce a process's place in the world through environment variables:
  - MPICH / Intel MPI (Hydra) and Slurm's PMI-1/2: PMI_RANK, PMI_SIZE;
  - Open MPI (mpirun / prterun):                  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
  - PMIx launchers (srun --mpi=pmix, prterun):    PMIX_RANK (no size variable: asked from MPI).
Nothing imports mpi4py unless one of them is set, so a plain run never initializes MPI.

The rank on its node (`local_rank`, which picks the GPU: local rank -> device) comes from MPI_LOCALRANKID (Hydra),
OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), PMIX_LOCAL_RANK (PMIx) or SLURM_LOCALID (srun), else from MPI itself
(the rank within COMM_WORLD split by shared memory).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moe_export.common.mapping import Mapping as RankMapping

# (rank variable, size variable or None) per launcher family, in the order they are checked.
LAUNCHER_VARS: tuple[tuple[str, str | None], ...] = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", None),
)


def mpi_world(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, world size) when an MPI launcher started this process, else None.

    A PMIx launch gives the rank only; the size then comes from MPI.COMM_WORLD (mpi4py is imported)."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARS:
        if rank_var not in env:
            continue
        rank = int(env[rank_var])
        if size_var is not None and size_var in env:
            return rank, int(env[size_var])
        if size_var is None:
            from mpi4py import MPI

            return rank, MPI.COMM_WORLD.Get_size()
    return None


LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank among the processes of its node (0 when no MPI launcher started it)."""
    env = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        if var in env:
            return int(env[var])
    if mpi_world(env) is None:
        return 0
    from mpi4py import MPI

    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def device_for_local_rank(local: int, device_count: int, environ: Mapping[str, str] | None = None) -> int:
    """The GPU a rank uses: one GPU per local rank. A launcher that already gave each task its own GPU
    (`srun --gpus-per-task=1`: CUDA_VISIBLE_DEVICES names one device, the local rank may be anything) leaves
    device 0. More local ranks than visible GPUs otherwise is an error (two ranks on one GPU would each size
    their pools for the whole GPU)."""
    env = os.environ if environ is None else environ
    if device_count < 1:
        raise RuntimeError("no CUDA device is visible to this process")
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if device_count == 1 and len(visible) == 1:
        return 0
    if local >= device_count:
        raise RuntimeError(f"local rank {local} but only {device_count} CUDA device(s) visible: start at most "
                           f"{device_count} ranks per node (or fix CUDA_VISIBLE_DEVICES)")
    return local


class SerialWorld:
    """The world of a process no MPI launcher started: one process."""

    rank, size = 0, 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


def world_comm():
    """MPI.COMM_WORLD when an MPI launcher started this process (mpi4py is imported only then), else a
    `SerialWorld`; both have rank, size and allgather."""
    if mpi_world() is None:
        return SerialWorld()
    from mpi4py import MPI

    return MPI.COMM_WORLD


def mpi_group_comms(mapping: RankMapping) -> dict[str, Any]:
    """MPI sub-communicators of this rank's "tp" and "ep" groups (consecutive ranks), split from COMM_WORLD.
    Collective: every rank of the world calls it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return {kind: world.Split(mapping.group_index(kind), mapping.rank) for kind in ("tp", "ep")}


def torch_group_comms(mapping: RankMapping, backend: str, timeout_s: float | None = None) -> dict[str, Any]:
    """torch.distributed process groups of this rank's "tp" and "ep" groups over `backend` ("nccl" on GPUs,
    "gloo" on CPU). The default group is initialized from MPI's launch: rank 0's host and a free port are
    broadcast over COMM_WORLD (or MASTER_ADDR / MASTER_PORT when set). Collective: every rank calls it, and every
    rank creates every group (torch.distributed requires it). `timeout_s`: the collectives' timeout (torch's
    default when None)."""
    import datetime
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        if mapping.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                addr, port = socket.gethostname(), str(s.getsockname()[1])
        addr, port = MPI.COMM_WORLD.bcast((addr, port), root=0)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=mapping.rank,
                            world_size=mapping.world_size, timeout=timeout)
    mine = {}
    for kind in ("tp", "ep"):
        for ranks in mapping.groups(kind):
            group = dist.new_group(list(ranks))
            if mapping.rank in ranks:
                mine[kind] = group
    return mine

"""Which MPI launcher started this process, if any: the one detection used by `build` and the engine.

Launchers announce a process's place in the world through environment variables:
  - MPICH / Intel MPI (Hydra) and Slurm's PMI-1/2: PMI_RANK, PMI_SIZE;
  - Open MPI (mpirun / prterun):                  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
  - PMIx launchers (srun --mpi=pmix, prterun):    PMIX_RANK (no size variable: asked from MPI).
Nothing imports mpi4py unless one of them is set, so a plain run never initializes MPI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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

"""A non-leader rank of a Triton deployment started under mpiexec (see `repo`):
`python -m moe_export.runtime.entrypoints.triton.follower ENGINE` loads this rank of the engine and follows the
leader's (the Triton model on rank 0) step plans until the leader shuts down."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from moe_export.common.errors import InputError
    from moe_export.common.mpi import mpi_world
    from moe_export.runtime.client.llm import LLM

    if len(argv) != 1:
        print("usage: python -m moe_export.runtime.entrypoints.triton.follower ENGINE_DIR", file=sys.stderr)
        return 2
    world = mpi_world()
    if world is None or world[0] == 0:
        print("error: run this under mpiexec as rank 1..W-1 (rank 0 is the tritonserver leader)", file=sys.stderr)
        return 2
    try:
        llm = LLM(argv[0])
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    llm.run_follower()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

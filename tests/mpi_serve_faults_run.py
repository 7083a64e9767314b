"""Run under `mpiexec -n WORLD`: `moe-export serve` (the CLI's own main) with argv[1:] as its arguments, after
wrapping one function per fault below; the test arms a fault by creating a file of that name in the folder
$MOE_EXPORT_TEST_FAULTS, and an armed fault fires once (its file is removed), raising RuntimeError where it sits:
  row      rank 0: building the next sampling row (a value that got past validation)
  sampler  rank 0: the next call of the sampler (choosing a step's tokens, after the step's collectives)
  grammar  rank 0: the next grammar bitmask of a structured-output request
  decoder  rank 0: the next detokenizer push
  parser   rank 0: the next chat output parser feed
  runner   rank 2: its next engine step (inside the collective part of a world step)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moe_export.common.mpi import mpi_world

ARMED = Path(os.environ["MOE_EXPORT_TEST_FAULTS"])


def inject(owner, attr: str, fault: str) -> None:
    """`owner.attr` raises once after the test arms `fault`."""
    real = getattr(owner, attr)

    def armed(*args, **kwargs):
        try:
            (ARMED / fault).unlink()
        except FileNotFoundError:
            return real(*args, **kwargs)
        raise RuntimeError(f"injected {fault} fault")

    setattr(owner, attr, armed)


def main() -> None:
    from moe_export.runtime.core import scheduler
    from moe_export.runtime.core.structured import GrammarLogitsProcessor
    from moe_export.runtime.engine import ort, runner
    from moe_export.runtime.entrypoints.cli import main as cli_main
    from moe_export.runtime.formats.parsing import OutputParser
    from moe_export.runtime.tokenizer import _Utf8Decoder

    rank = mpi_world()[0]
    if rank == 0:
        inject(scheduler, "build_row", "row")
        inject(runner, "sample", "sampler")
        inject(GrammarLogitsProcessor, "fill_bitmask", "grammar")
        inject(_Utf8Decoder, "push", "decoder")
        inject(OutputParser, "feed", "parser")
    if rank == 2:
        inject(ort.Engine, "sample", "runner")
    sys.argv = ["moe-export", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()

"""Run under `mpiexec -n WORLD` on the engine argv[1]: rank 0's scheduler breaks (an exception out of its planning,
before any broadcast), so its engine core dies; rank 0 prints one JSON line {"error": the EngineDead's class,
"healthy": LLM.healthy, "later": the class a later request raises}; the other ranks print "released" when
`run_follower()` returns."""

from __future__ import annotations

import json
import sys

from moe_export.runtime.entrypoints.llm import LLM
from moe_export.runtime.sampling import SamplingParams


def main() -> None:
    llm = LLM(sys.argv[1], threads=1)
    if not llm.engine.is_root:
        llm.run_follower()
        print("released", flush=True)
        return

    def broken_plan(resets, restores):
        raise AssertionError("two sequences hold one slot")

    llm._root().engine_core.scheduler._plan = broken_plan
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = {}
    for key in ("error", "later"):
        try:
            llm.generate([[5, 6, 7]], params)
        except Exception as exc:
            out[key] = type(exc).__name__
    out["healthy"] = llm.healthy
    llm.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

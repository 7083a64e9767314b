"""Run under `mpiexec -n WORLD` (a tp-layout engine, any runner: `open_engine`): every rank opens its own offload store in argv[2] (its
`rank{N}/`), rank 0 runs the prompt argv[3] (JSON token ids) for argv[4] greedy tokens with prefix caching, the other
ranks follow. Rank 0 prints one JSON line: {"tokens", "cached" (prompt tokens resumed), "loaded" (of them from the
store), "rejected" / "written" (per rank: files that failed their check, files written)}."""

from __future__ import annotations

import json
import sys

from moe_export.runtime.core.contracts import Request
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.execution import follow
from moe_export.runtime.core.state_offload import open_state_offload
from moe_export.runtime.engine import open_engine
from moe_export.runtime.sampling import SamplingParams


def offload_turn(engine, engine_dir: str, store: str, prompt: list[int], n: int) -> dict | None:
    """The turn on an opened runner (every rank): rank 0 returns the JSON line's dict, the other ranks None."""
    offload = open_state_offload(engine, engine_dir, store, host_bytes=1 << 30, disk_bytes=1 << 30)
    world = engine.comm.world
    if not engine.is_root:
        follow(engine, offload)
        offload.store.close()
        world.gather((offload.store.rejected, offload.store.written), root=0)
        return None
    core = EngineCore(engine, offload=offload, overlap=True)
    core.add(Request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    tokens, cached = [], 0
    while core.has_work:
        for u in core.step():
            tokens += u.token_ids
            cached = max(cached, u.cached_tokens)
    core.shutdown()
    counts = world.gather((offload.store.rejected, offload.store.written), root=0)
    return {"tokens": tokens, "cached": cached, "loaded": offload.loaded_tokens,
            "rejected": [c[0] for c in counts], "written": [c[1] for c in counts]}


def main() -> None:
    engine_dir = sys.argv[1]
    out = offload_turn(open_engine(engine_dir, threads=1), engine_dir, sys.argv[2], json.loads(sys.argv[3]),
                       int(sys.argv[4]))
    if out is not None:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

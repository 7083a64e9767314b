"""Run under `mpiexec -n WORLD`: rank 0 schedules the requests in argv[2] (JSON list of {prompt,
max_tokens}) together on the engine argv[1]; other ranks follow. Rank 0 prints one JSON line:
{"tokens": [...per request], "root_steps": N, "follower_steps": [...]}.
With PREFIX_CACHING=1 the requests run one after another with prefix caching on (a request whose spec has
"with_next": true is added together with the next one), and the line also holds "cached": [...per request] (prompt
tokens resumed from the prefix cache); a spec's "turn_points" are its `Request.turn_points`. With OVERLAP=1 rank 0 plans each
step while the previous one runs (`EngineCore(overlap=True)`: broadcasts and steps in its worker thread), and
the line also holds "planned_ahead".

Failure injection for the stop-the-world test: FAIL_RANK / FAIL_AT_STEP make that rank's engine.step
raise at that step."""

from __future__ import annotations

import json
import os
import sys

from moe_export.runtime.core.execution import follow
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.sampling import SamplingParams


def main() -> None:
    engine = Engine(sys.argv[1], threads=1)
    rank = engine.comm.world.Get_rank()
    if os.environ.get("FAIL_RANK") == str(rank):
        real_step, calls = engine.step, [0]

        def failing_step(batch):
            calls[0] += 1
            if calls[0] == int(os.environ["FAIL_AT_STEP"]):
                raise RuntimeError(f"injected failure at step {calls[0]}")
            return real_step(batch)

        engine.step = failing_step
    if not engine.is_root:
        steps = follow(engine)
        engine.comm.world.gather(steps, root=0)
        return
    spec = json.loads(sys.argv[2])
    one_by_one = os.environ.get("PREFIX_CACHING") == "1"
    sched = EngineCore(engine, keep_sessions=False, prefix_caching=one_by_one, overlap=os.environ.get("OVERLAP") == "1")
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(spec))}
    cached: dict[str, int] = {str(i): 0 for i in range(len(spec))}
    steps = 0

    def drain():
        nonlocal steps
        while sched.has_work:
            for u in sched.step():
                tokens[u.request_id].extend(u.token_ids)
                cached[u.request_id] = max(cached[u.request_id], u.cached_tokens)
            steps += 1

    for i, s in enumerate(spec):
        sched.add(Request(str(i), s["prompt"], SamplingParams(max_tokens=s["max_tokens"], ignore_eos=True),
                          turn_points=tuple(s.get("turn_points", ()))))
        if one_by_one and not s.get("with_next"):
            drain()
    drain()
    sched.shutdown()
    follower_steps = engine.comm.world.gather(steps, root=0)[1:]
    out = {"tokens": [tokens[str(i)] for i in range(len(spec))], "root_steps": steps, "follower_steps": follower_steps}
    if sched.overlap:
        out["planned_ahead"] = sched.planned_ahead
    if one_by_one:
        out["cached"] = [cached[str(i)] for i in range(len(spec))]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

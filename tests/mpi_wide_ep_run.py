"""Run under `mpiexec -n WORLD` on a dp-layout engine (argv[1]): every rank opens `LLM`; rank 0 runs the rounds
in argv[2] (JSON list of rounds, each {prompts: [[ids]], max_tokens}), one `generate` call per round
(greedy, eos ignored), the other ranks `run_follower()`. Rank 0 prints one JSON line: {"rounds": [[tokens per
request]], "groups": [[group per request]], "expert_tokens": per MoE layer per expert (all ranks' dispatches),
"sent_bytes": {kind: bytes, all ranks}, "moe_tokens": all ranks, "stats_expert_load" and "stats": from rank 0's stats() after the rounds, "blocks_per_rank"}. With argv[3] "abort", an AsyncLLM
phase follows (`abort_phase`), reported under "aborted"."""

from __future__ import annotations

import json
import sys

import numpy as np

from moe_export.runtime import LLM
from moe_export.runtime.sampling import SamplingParams


def abort_phase(llm) -> dict:
    """AsyncLLM over the same LLM: three streams start together (groups 0, 1, 2); the one in group 1 is dropped
    after its first token (its stream closed: an abort travels to group 1's leader), the others finish."""
    import asyncio

    from moe_export.runtime.entrypoints.llm import AsyncLLM

    engine = AsyncLLM(llm)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def run() -> dict:
        async def whole(prompt):
            return [d async for d in engine.generate_stream(prompt, params)][-1].output.output_ids

        async def first_then_drop(prompt):
            async for delta in engine.generate_stream(prompt, params):
                return delta.token_ids

        a = asyncio.create_task(whole([11, 12, 13]))
        await asyncio.sleep(0)
        b = asyncio.create_task(first_then_drop([21, 22, 23]))
        await asyncio.sleep(0)
        c = asyncio.create_task(whole([31, 32, 33]))
        return {"a": await a, "b": await b, "c": await c}

    out = asyncio.run(run())
    engine.shutdown()  # the LLM was passed in: it stays usable
    out["after"] = llm.stats()["running"]
    history = llm._core.engine_core.history  # finished (not aborted) prompts -> their group
    out["groups"] = [history.get((11, 12, 13)), history.get((31, 32, 33))]
    return out


def main() -> None:
    llm = LLM(sys.argv[1], threads=1, reuse_sessions=True)
    comm = llm.engine.comm
    if not llm.engine.is_root:
        llm.run_follower()
        comm.world.gather((llm.engine.expert_tokens, llm.engine.traffic), root=0)
        return
    rounds, groups = [], []
    for spec in json.loads(sys.argv[2]):
        results = llm.generate(spec["prompts"], SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True))
        rounds.append([r.output_ids for r in results])
        history = llm._core.engine_core.history
        groups.append([history.get(tuple(p)) for p in spec["prompts"]])
    stats = llm.stats()  # before the abort phase
    aborted = abort_phase(llm) if sys.argv[3:] == ["abort"] else None
    llm.shutdown()
    parts = comm.world.gather((llm.engine.expert_tokens, llm.engine.traffic), root=0)
    sent: dict[str, int] = {}
    for _, traffic in parts:
        for kind, n in traffic.sent_bytes.items():
            sent[kind] = sent.get(kind, 0) + n
    print(json.dumps({"rounds": rounds, "groups": groups,
                      "expert_tokens": np.sum([p[0] for p in parts], axis=0).tolist(), "sent_bytes": sent,
                      "moe_tokens": sum(p[1].moe_tokens for p in parts), "stats_expert_load": stats["expert_load"],
                      "stats": {k: stats[k] for k in ("blocks_total", "groups", "running", "waiting")},
                      "blocks_per_rank": llm.engine.num_blocks, "aborted": aborted}))


if __name__ == "__main__":
    main()

"""Run under `mpiexec -n WORLD` on a dp-layout engine (argv[1]): every rank opens `LLM`; rank 0 runs the rounds
in argv[2] (JSON list of rounds, each {prompts: [[ids]], max_tokens}), one `generate` call per round
(greedy, eos ignored), the other ranks `run_follower()`. Rank 0 prints one JSON line: {"rounds": [[tokens per
request]], "groups": [[group per request]], "expert_tokens": per MoE layer per expert (all ranks' dispatches),
"sent_bytes": {kind: bytes, all ranks}, "moe_tokens": all ranks, "stats_expert_load" and "stats": from rank 0's stats(), "blocks_per_rank"}."""

from __future__ import annotations

import json
import sys

import numpy as np

from moe_export.runtime import LLM
from moe_export.runtime.sampling import SamplingParams


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
        history = llm._core.sched.history
        groups.append([history.get(tuple(p)) for p in spec["prompts"]])
    stats = llm.stats()
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
                      "blocks_per_rank": llm.engine.num_blocks}))


if __name__ == "__main__":
    main()

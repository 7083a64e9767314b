"""Run under `mpiexec -n WORLD` on a dp-layout engine: rank 0 sends the chats in argv[2] (JSON list of conversations,
image parts allowed) in one `LLM.chat` call (the first lands in group 0, the next in groups 1, 2, ..., so an image
chat runs in another group than rank 0's), greedy for argv[3] tokens; prints {"outputs": [output ids per chat]}."""

from __future__ import annotations

import json
import sys

from moe_export.runtime import LLM, SamplingParams


def main() -> None:
    llm = LLM(sys.argv[1], threads=1)
    if not llm.engine.is_root:
        llm.run_follower()
        return
    chats = json.loads(sys.argv[2])
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=int(sys.argv[3])), reasoning_effort="none")
    llm.shutdown()
    print(json.dumps({"outputs": [o.output_ids for o in outs]}))


if __name__ == "__main__":
    main()

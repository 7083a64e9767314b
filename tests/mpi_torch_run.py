"""Run under `mpiexec -n WORLD` on an engine (argv[1]): every rank opens `LLM`; rank 0 runs `generate` on the prompts
in argv[2] (a JSON list of token-id lists) greedily for argv[3] tokens, then, when argv[4] is a JSON chat (messages
with image parts), `chat` on it; the other ranks follow. Rank 0 prints {"tokens": [[...]], "chat": [...] | null}."""

from __future__ import annotations

import json
import sys

from moe_export.runtime import LLM, SamplingParams


def main() -> None:
    llm = LLM(sys.argv[1], threads=1)
    if not llm.engine.is_root:
        llm.run_follower()
        return
    greedy = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
    tokens = [o.output_ids for o in llm.generate(json.loads(sys.argv[2]), greedy)]
    chat = None
    if len(sys.argv) > 4:
        chat = llm.chat([json.loads(sys.argv[4])], greedy, reasoning_effort="none")[0].output_ids
    llm.shutdown()
    print(json.dumps({"tokens": tokens, "chat": chat}))


if __name__ == "__main__":
    main()

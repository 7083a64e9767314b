"""Run under `mpiexec -n WORLD`: rank 0 sends the chat in argv[2] (a JSON list of messages with image parts) to
`LLM(argv[1]).chat` greedily for argv[3] tokens and prints {"prompt_ids": [...], "output_ids": [...]}; the other
ranks follow (the tower runs data-parallel over rank 0's attention group)."""

from __future__ import annotations

import json
import sys

from moe_export.runtime import LLM, SamplingParams


def main() -> None:
    llm = LLM(sys.argv[1], threads=1)
    if not llm.engine.is_root:
        llm.run_follower()
        return
    messages = json.loads(sys.argv[2])
    out = llm.chat([messages], SamplingParams(temperature=0, max_tokens=int(sys.argv[3])), reasoning_effort="none")[0]
    llm.shutdown()
    print(json.dumps({"prompt_ids": out.prompt_ids, "output_ids": out.output_ids}))


if __name__ == "__main__":
    main()

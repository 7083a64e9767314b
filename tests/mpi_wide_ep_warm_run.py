"""Run under `mpiexec -n 2` on a tp 1 x dp 2 engine (argv[1]): warm turns in the dp layout (`GroupedScheduler.add_warm`).
Rank 0 runs two phases and prints one JSON line:
- "chat": two rounds of a `tool_choice: "required"` chat (greedy, the history resent through chat completions; the
  first request, least loaded: group 0): each round's output ids and cached tokens, the warm prompt's length after round 1
  and the conversation's end (`history_len`);
- "group1": token prompts through `generate`: [other, first] (least loaded: group 0, then group 1), then a warm turn
  of first's conversation + its output (`add_warm`, the output standing where first's instruction stood), then the
  next prompt (the warm prompt + a tool answer + the instruction) sent at once (it waits for the warm turn): the
  groups of first, the warm turn and next, next's cached tokens and every output.
The other rank runs `run_follower()`."""

from __future__ import annotations

import json
import sys

from test_warm_turns import REQUIRED, next_prompt_messages

from moe_export.runtime import LLM
from moe_export.runtime.core.contracts import Request
from moe_export.runtime.sampling import SamplingParams

CONV, INSTRUCTION, ANSWER = list(range(40, 77)), list(range(300, 307)), list(range(200, 211))


def chat_phase(llm: LLM) -> dict:
    messages = [{"role": "user", "content": "Plan a week in Rome."}]
    rounds, warm_len, history_len = [], None, None
    for k, max_tokens in enumerate((300, 24)):
        rendered = llm.processor.render(messages, **REQUIRED)
        (out,) = llm.chat([messages], SamplingParams(max_tokens=max_tokens), **REQUIRED)
        rounds.append({"output_ids": out.output_ids, "cached_tokens": out.usage["cached_tokens"]})
        if not k:
            warm_len = len(llm.processor.next_turn_prompt(rendered, out.message()))
            history_len = rendered.history_len
            messages = next_prompt_messages("chat", messages, out, "rain, 14 C")
    return {"rounds": rounds, "warm_len": warm_len, "history_len": history_len}


def group1_phase(llm: LLM) -> dict:
    core = llm._core.engine_core
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    other, first = llm.generate([[7, 8, 9], CONV + INSTRUCTION], params)
    warm = CONV + first.output_ids
    core.add_warm(Request("first:warm", warm, SamplingParams(max_tokens=1)))
    (nxt,) = llm.generate([warm + ANSWER + INSTRUCTION], params)
    return {"groups": [core.history.get(tuple(CONV + INSTRUCTION)), core.history.get(tuple(warm)),
                       core.history.get(tuple(warm + ANSWER + INSTRUCTION))],
            "outputs": [other.output_ids, first.output_ids, nxt.output_ids], "warm_len": len(warm),
            "cached_tokens": nxt.usage["cached_tokens"]}


def run_on_root(llm: LLM, body) -> None:
    """Rank 0 runs `body(llm)` and prints its dict as JSON, shutting the LLM down even when it fails (which releases
    the followers); every other rank follows."""
    if not llm.engine.is_root:
        llm.run_follower()
        return
    try:
        out = body(llm)
    finally:
        llm.shutdown()
    print(json.dumps(out))


def main() -> None:
    run_on_root(LLM(sys.argv[1], threads=1, default_effort="low"), lambda llm: {
        "chat": chat_phase(llm), "group1": group1_phase(llm), "warm_turns": llm.stats()["warm_turns"]})


if __name__ == "__main__":
    main()

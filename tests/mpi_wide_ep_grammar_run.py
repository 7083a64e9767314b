"""Run under `mpiexec -n 2` on a tp 1 x dp 2 engine (argv[1]): a constrained turn of a conversation in group 1
(`wide_ep`: grammars travel as specs). Rank 0 runs, greedy, effort none, through `LLM`, and prints one JSON line:
1. two unconstrained chats at once (WEATHER declared, tool_choice auto): "other" (least loaded: group 0) and "conv"
   (group 1);
2. conv's next turn (its answer sent back with a new user message) with tool_choice "required" (a grammar; K3
   renders the tool-choice message after the conversation, so a warm turn follows it): it continues conv's prompt,
   so it goes to group 1;
3. the turn after it (the call and its result sent back) forcing a call of get_weather by name, cut short by
   max_tokens: it continues turn 2's warm prompt.
For each turn: its prompt and output ids, cached tokens and (turns 2 and 3) the state of rank 0's grammar processor
when the turn ended (`completed`, which the server reads, `failed`, `consumed`) and the tool calls; the groups every
prompt finished in (warm prompt included) and turn 2's warm prompt's length. The other rank runs
`run_follower()`."""

from __future__ import annotations

import sys

from mpi_wide_ep_warm_run import run_on_root

from moe_export.runtime import LLM
from moe_export.runtime.sampling import SamplingParams

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OTHER = [{"role": "user", "content": "Hello there."}]
CONV = [{"role": "user", "content": "What is the weather like in Rome today?"}]
FIRST, CALL, CUT = (SamplingParams(max_tokens=n, temperature=0.0) for n in (8, 150, 12))


def second_messages(first) -> list[dict]:
    """Turn 2's conversation: conv, its first answer (as generated: `turn_ids`) and a new user message."""
    return CONV + [first.message(), {"role": "user", "content": "Check it."}]


def third_messages(second_messages: list[dict], second) -> list[dict]:
    """Turn 3's conversation: turn 2's, its call (as generated) and the call's result."""
    return second_messages + [second.message(), {"role": "tool", "tool_call_id": second.tool_calls[0]["id"],
                                                 "content": "sunny, 21 C"}]


def constrained_turn(llm: LLM, messages: list[dict], sampling: SamplingParams, tool_choice) -> tuple[object, dict]:
    """One turn forcing a tool call: its output and rank 0's grammar processor's state at the end."""
    tracked = llm.prepare_chat(messages, sampling, tools=WEATHER, tool_choice=tool_choice)
    (out,) = llm._collect([tracked])
    grammar = tracked.grammar
    return out, {"completed": out.grammar_completed, "failed": grammar.failed, "consumed": grammar.consumed}


def turn(out, grammar: dict | None = None) -> dict:
    return {"prompt_ids": out.prompt_ids, "output_ids": out.output_ids, "cached_tokens": out.usage["cached_tokens"],
            "tool_calls": out.tool_calls, "grammar": grammar}


def conversation(llm: LLM) -> dict:
    """Rank 0's turns: the unconstrained conversation and the other prompt, then the two constrained turns."""
    core = llm._core.engine_core
    other, first = llm.chat([OTHER, CONV], FIRST, tools=WEATHER)
    messages = second_messages(first)
    rendered = llm.processor.render(messages, tools=WEATHER, tool_choice="required")
    second, second_grammar = constrained_turn(llm, messages, CALL, "required")
    warm = llm.processor.next_turn_prompt(rendered, second.message())
    third, third_grammar = constrained_turn(llm, third_messages(messages, second), CUT, NAMED)
    return {"turns": [turn(other), turn(first), turn(second, second_grammar), turn(third, third_grammar)],
            "groups": [core.history.get(tuple(p)) for p in (other.prompt_ids, first.prompt_ids, second.prompt_ids,
                                                            warm, third.prompt_ids)],
            "warm_len": len(warm), "warm_turns": llm.stats()["warm_turns"]}


def main() -> None:
    run_on_root(LLM(sys.argv[1], threads=1, default_effort="none"), conversation)


if __name__ == "__main__":
    main()

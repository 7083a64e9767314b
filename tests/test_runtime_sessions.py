"""Session state reuse: a follow-up turn continuing a kept sequence gives the same logits (up to float32 reordering) and tokens
as a full re-prefill, for every preset and several layouts, and through chat turns with tool calls,
tool results and budget-forced close markers; LRU eviction when slots run out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp32_reorder import num_layers, reorder_atol

from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.entrypoints.llm import LLM
from moe_export.runtime.sampling import SamplingParams

TURN1 = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400, 9, 9, 31, 64, 65, 66, 70]
TOOL_RESULT = [201, 202, 203, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]


class Recorder:
    """Logits processor recording the logits of every sampled step."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, _ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.clone())
        return logits


def run(sched: EngineCore, request_id: str, prompt: list[int], n: int) -> tuple[list[int], Recorder, int]:
    rec = Recorder()
    sched.add(Request(request_id, prompt, SamplingParams(max_tokens=n, ignore_eos=True), [rec]))
    tokens, cached = [], 0
    while sched.has_work:
        for u in sched.step():
            tokens += u.token_ids
            cached = max(cached, u.cached_tokens)
    return tokens, rec, cached


def assert_same(a: Recorder, b: Recorder, engine) -> None:
    """The same logits up to float32 reordering (kept state vs a full prefill sum in other orders) over sums of up
    to the engine's max_seq_len positions."""
    assert len(a.logits) == len(b.logits)
    for k, (x, y) in enumerate(zip(a.logits, b.logits)):
        atol = reorder_atol(y.numpy(), num_layers(engine.model_config), engine.max_seq_len)
        np.testing.assert_allclose(x.numpy(), y.numpy(), atol=atol, rtol=0, err_msg=f"step {k}")


@pytest.mark.parametrize("preset, tp, ep, world", [
    ("tiny-k3", 2, 2, 4), ("tiny-k3-dsa", 2, 2, 4), ("tiny-kimi-linear", 2, 2, 4), ("tiny-k3", 1, 1, 1), ("tiny-k3", 1, 4, 4),
])
def test_follow_up_turns_with_reuse_equal_full_prefill(runtime_engine, preset, tp, ep, world):
    """Three turns: each follow-up prompt = everything so far + new tokens (crossing block and chunk bounds)."""
    eng = Engine(runtime_engine(preset, tp, ep, world), threads=1)
    kept = EngineCore(eng)
    out1, _, cached = run(kept, "t1", TURN1, 6)
    assert cached == 0
    prompt2 = TURN1 + out1 + TOOL_RESULT
    out2, rec2, cached2 = run(kept, "t2", prompt2, 5)
    assert cached2 == len(TURN1) + len(out1) - 1
    prompt3 = prompt2 + out2 + TOOL_RESULT[:7]
    out3, rec3, cached3 = run(kept, "t3", prompt3, 4)
    assert cached3 == len(prompt2) + len(out2) - 1
    assert kept.stats()["reuse_hits"] == 2

    fresh = EngineCore(eng, keep_sessions=False, prefix_caching=False)  # the oracle: full prefills
    full2, frec2, c2 = run(fresh, "f2", prompt2, 5)
    full3, frec3, c3 = run(fresh, "f3", prompt3, 4)
    assert c2 == c3 == 0 and fresh.stats()["reuse_hits"] == 0
    assert (out2, out3) == (full2, full3)
    assert_same(rec2, frec2, eng)
    assert_same(rec3, frec3, eng)


def test_no_reuse_without_an_exact_prefix_and_lru_eviction(runtime_engine):
    eng = Engine(runtime_engine("tiny-k3", 2, 2, 4), num_slots=2, threads=1)
    sched = EngineCore(eng, prefix_caching=False)  # kept sessions alone (the prefix cache: test_runtime_prefix_cache)
    out_a, _, _ = run(sched, "a", TURN1, 3)
    out_b, _, _ = run(sched, "b", TOOL_RESULT, 3)
    assert sched.stats()["kept_sessions"] == 2
    # a changed token inside the history: a full prefill, equal to a fresh run
    changed = TURN1[:5] + [6] + TURN1[6:] + out_a + [1, 2, 3]
    got, rec, cached = run(sched, "c", changed, 3)
    assert cached == 0
    # "c" needed a slot: the least recently used session ("a") was evicted, "b" is still reusable
    _, _, cached_b = run(sched, "b2", TOOL_RESULT + out_b + [4, 5], 2)
    assert cached_b == len(TOOL_RESULT) + len(out_b) - 1
    _, _, cached_a = run(sched, "a2", TURN1 + out_a + [4, 5], 2)
    assert cached_a == 0
    other = Engine(runtime_engine("tiny-k3", 2, 2, 4), num_slots=1, threads=1)  # its own state pools
    want, frec, _ = run(EngineCore(other, keep_sessions=False, prefix_caching=False), "fc", changed, 3)
    assert got == want
    assert_same(rec, frec, eng)


def test_turn_memory_keys_by_the_parsed_message_within_a_token_bound():
    mem = TurnMemory(max_tokens=10)
    a = {"role": "assistant", "content": "hi", "reasoning_content": None}
    mem.remember(a, [1, 2, 3, 4])
    assert mem.recall({**a, "reasoning_content": "", "turn_ids": [9]}) == [1, 2, 3, 4]  # None == "", turn_ids aside
    assert mem.recall({**a, "content": "hi!"}) is None
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    mem.remember({**a, "tool_calls": calls}, [5] * 5)
    assert mem.recall({**a, "tool_calls": calls}) == [5] * 5
    assert mem.recall({**a, "tool_calls": [{**calls[0], "id": "c2"}]}) is None
    assert mem.recall(a) == [1, 2, 3, 4]  # now the most recently used
    mem.remember({**a, "content": "x"}, [7] * 4)  # 13 tokens > 10: the least recently used turn goes
    assert mem.recall({**a, "tool_calls": calls}) is None and mem.recall(a) == [1, 2, 3, 4]
    assert mem.recall({"role": "assistant", "content": [{"type": "image_url"}]}) is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


class Script:
    """Logits processor steering output: reasoning tokens `long_reasoning` (longer than the cap, so the
    budget must force the close marker), then, once the forced marker is out, the tokens `tail`."""

    def __init__(self, long_reasoning: list[int], marker: list[int], tail: list[int]) -> None:
        self.long_reasoning, self.marker, self.tail = long_reasoning, marker, tail

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        k, m = len(ids), len(self.marker)
        ends = [i + m for i in range(len(ids) - m + 1) if ids[i:i + m] == self.marker]
        target = self.tail[k - ends[0]] if ends else self.long_reasoning[k]
        out = torch.full_like(logits, float("-inf"))
        out[target] = 0.0
        return out


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_chat_turns_with_tool_calls_and_forced_markers_reuse_state(runtime_engine, preset):
    engine_dir = runtime_engine(preset, 2, 2, 4)
    llm, fresh = LLM(engine_dir, threads=1), LLM(engine_dir, threads=1)
    tok, family = llm.tokenizer, llm.family
    history = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    cap = llm.thinking_caps["low"]
    kw = {"family": family, "tools": TOOLS, "thinking": True, "thinking_effort": "low"}
    from moe_export.runtime.chat import render_ids

    prompt1 = render_ids(tok, history, **kw)
    long_reasoning = tok.encode("1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9")
    reasoning = tok.decode(long_reasoning[:cap])
    assert tok.encode(reasoning) == long_reasoning[:cap]
    call_id = "functions.get_weather:0"
    want = {"role": "assistant", "reasoning_content": reasoning, "content": "Calling.",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    full = render_ids(tok, history + [want], add_generation_prompt=False, **kw)
    assert full[: len(prompt1)] == prompt1
    turn = full[len(prompt1):]
    if family == "k3":
        opens = []
        marker = [tok.encode_special("<|close|>"), *tok.encode("think"), tok.encode_special("<|sep|>"),
                  tok.encode_special("<|open|>"), *tok.encode("response"), tok.encode_special("<|sep|>")]
    else:  # K2-Thinking's generation prompt does not open reasoning: the model writes <think> first
        opens = [tok.encode_special("<think>")]
        marker = [tok.encode_special("</think>")]
    start = len(opens)
    assert turn[:start] == opens and turn[start + cap: start + cap + len(marker)] == marker
    script = Script(opens + long_reasoning, marker, turn[start + cap + len(marker):])

    out1 = llm.chat([history], SamplingParams(max_tokens=len(turn) + 5), tools=TOOLS, reasoning_effort="low",
                    logits_processors=[script])[0]
    assert out1.output_ids == turn and out1.finish_reason == "tool_calls"
    assert out1.usage["reasoning_tokens"] == cap and out1.reasoning_content == reasoning
    assert [c["function"] for c in out1.tool_calls] == [want["tool_calls"][0]["function"]]
    assistant = {"role": "assistant", "reasoning_content": out1.reasoning_content, "content": out1.content,
                 "tool_calls": out1.tool_calls}
    history2 = history + [assistant, {"role": "tool", "tool_call_id": out1.tool_calls[0]["id"], "content": "18 C, sunny"}]

    rec, frec = Recorder(), Recorder()
    params = SamplingParams(max_tokens=8)
    out2 = llm.chat([history2], params, tools=TOOLS, reasoning_effort="low", logits_processors=[rec])[0]
    assert out2.usage["cached_tokens"] == len(prompt1) + len(turn) - 1
    ref = fresh.chat([history2], params, tools=TOOLS, reasoning_effort="low", logits_processors=[frec])[0]
    assert ref.usage["cached_tokens"] == 0 and ref.prompt_ids == out2.prompt_ids
    assert ref.output_ids == out2.output_ids
    assert_same(rec, frec, llm.engine)
    llm.shutdown()
    fresh.shutdown()


@pytest.mark.parametrize("preset", ["tiny-k3"])
def test_turn_sent_back_as_text_continues_the_kept_state(runtime_engine, preset):
    """A client sends the assistant's turn back as text (reasoning, content); encoding that text again gives
    other tokens than the model sampled. The turn is rendered as its generated tokens, so turn 2 prefills only
    its new tokens, with the logits and tokens of a full prefill of the same prompt, and the prompt is still
    the chat format's (same text, same markers). An edited turn is rendered from its text. (K3 keeps every
    turn's reasoning with thinking on; K2's changing history: the next test.)"""
    from conftest import TextOnly

    from moe_export.runtime.chat import render_ids
    from moe_export.graphs.tokens import END_OF_MESSAGE

    llm = LLM(runtime_engine(preset, 2, 2, 4), threads=1, prefix_caching=False)  # kept sessions alone
    tok = llm.tokenizer
    text_only = TextOnly(tok, keep={tok.encode_special(END_OF_MESSAGE[llm.family])})
    history = [{"role": "user", "content": "Plan a trip to Rome."}]

    def chat(messages, *processors, max_tokens=8):
        return llm.chat([messages], SamplingParams(max_tokens=max_tokens), reasoning_effort="low",
                        logits_processors=[text_only, *processors])[0]

    out1 = chat(history, max_tokens=24)
    assert out1.usage["reasoning_tokens"] == llm.thinking_caps["low"] and out1.content
    sent_back = {"role": "assistant", "content": out1.content, "reasoning_content": out1.reasoning_content}
    history2 = history + [sent_back, {"role": "user", "content": "And then?"}]
    kept = out1.prompt_ids + out1.output_ids[:-1]
    encoded = render_ids(tok, history2, thinking=True, thinking_effort="low")
    assert encoded[: len(kept)] != kept  # precondition: the reply's text does not re-encode to its tokens

    rec, frec = Recorder(), Recorder()
    out2 = chat(history2, rec)
    assert out2.usage["cached_tokens"] == len(kept) and out2.prompt_ids[: len(kept)] == kept
    assert tok.decode(out2.prompt_ids) == tok.decode(encoded)
    assert [t for t in out2.prompt_ids if tok.is_special(t)] == [t for t in encoded if tok.is_special(t)]
    again = chat(history2, frec)  # no kept sequence is a prefix now (turn 2's own is longer): a full prefill
    assert again.usage["cached_tokens"] == 0 and again.prompt_ids == out2.prompt_ids
    assert again.output_ids == out2.output_ids
    assert_same(rec, frec, llm.engine)

    out3 = chat(history2 + [again.message(), {"role": "user", "content": "Thanks."}])  # the Python API's own history
    assert out3.usage["cached_tokens"] == len(again.prompt_ids) + len(again.output_ids) - 1
    edited = history + [{**sent_back, "content": out1.content + "!"}, {"role": "user", "content": "And then?"}]
    out4 = chat(edited)
    assert out4.usage["cached_tokens"] == 0
    assert out4.prompt_ids == render_ids(tok, edited, thinking=True, thinking_effort="low")
    llm.shutdown()


def test_k2_dropped_reasoning_is_not_reused_as_unchanged(runtime_engine):
    """K2-Thinking renders a plain answer's reasoning as `<think></think>` once it is history, so the tokens the
    turn was generated with are no longer a prefix of the next prompt: the kept state must not be reused. Turn 2
    equals a full prefill (same prompt, tokens and logits) and its prompt is the format's (reasoning dropped); the
    prefix cache resumes it at exactly turn 1's prompt end (the checkpoint of that turn point: the cache reaches up
    to the dropped reasoning), at or before the point where it leaves turn 1's tokens. The agent loop (turns with
    tool calls keep their reasoning) reuses: the tool-call test above."""
    from conftest import OpensThink, TextOnly

    from moe_export.runtime.chat import render_ids
    from moe_export.graphs.tokens import END_OF_MESSAGE

    engine_dir = runtime_engine("tiny-kimi-linear", 2, 2, 4)
    llm, fresh = LLM(engine_dir, threads=1), LLM(engine_dir, threads=1, prefix_caching=False)
    tok = llm.tokenizer
    steer = [TextOnly(tok, keep={tok.encode_special(END_OF_MESSAGE["k2"])}), OpensThink(tok, "k2")]
    history = [{"role": "user", "content": "Plan a trip to Rome."}]
    out1 = llm.chat([history], SamplingParams(max_tokens=24), reasoning_effort="low", logits_processors=steer)[0]
    assert out1.reasoning_content and out1.usage["reasoning_tokens"] == llm.thinking_caps["low"]
    history2 = history + [out1.message(), {"role": "user", "content": "And then?"}]
    prompt2 = render_ids(tok, history2)
    kept = out1.prompt_ids + out1.output_ids[:-1]
    assert prompt2[: len(kept)] != kept and out1.reasoning_content not in tok.decode(prompt2)
    assert "<think></think>" in tok.decode(prompt2)

    rec, frec = Recorder(), Recorder()
    params = SamplingParams(max_tokens=8)
    out2 = llm.chat([history2], params, reasoning_effort="low", logits_processors=[*steer, rec])[0]
    ref = fresh.chat([history2], params, reasoning_effort="low", logits_processors=[*steer, frec])[0]
    same = next(i for i, (a, b) in enumerate(zip(prompt2, kept)) if a != b)
    cached = out2.usage["cached_tokens"]
    assert cached == len(out1.prompt_ids) <= same and ref.usage["cached_tokens"] == 0
    assert out2.prompt_ids == ref.prompt_ids == prompt2
    assert out2.output_ids == ref.output_ids
    assert_same(rec, frec, llm.engine)
    llm.shutdown()
    fresh.shutdown()

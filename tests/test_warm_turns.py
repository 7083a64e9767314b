"""Warm turns (`Scheduler.add_warm`): when a chat whose next prompt departs from its own finishes (K3's tool-choice
message after the conversation), the start of the next prompt (the conversation and the turn just generated) is
prefilled in the background and kept, so the next turn resumes after the model's own output.

The warm prompt is the next prompt's prefix as each API's next request renders it (chat completions and Anthropic
messages resending the history, a Responses chain); a request continuing a warm turn waits for it (no second
prefill); a warm turn runs only when no request waits, samples nothing, reports nothing and gives its slot up to a
request; greedy tokens and logits equal a cacheless engine's over several rounds; `warm_turns=False` turns it off."""

from __future__ import annotations

import pytest
from test_runtime_prefix_cache import BASE, oracle, run_turn, tail
from test_runtime_sessions import Recorder, assert_same

from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.entrypoints.llm import LLM
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.sampling import SamplingParams

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}]
REQUIRED = {"tools": WEATHER, "tool_choice": "required", "reasoning_effort": "low"}


def warm(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1))


def test_a_request_continuing_a_warm_turn_resumes_at_its_end_and_waits_for_it(runtime_engine):
    """Core level: a turn's prompt is the conversation + an instruction after it; the warm turn (conversation +
    output) resumes at the conversation's end and prefills only the output; the next prompt (warm + tool answer +
    instruction) resumes at the warm turn's end with the tokens and logits of a full prefill. Sent before the warm
    turn ran (the agent loop's race), the request waits for it: the warm turn is admitted first and the output's
    tokens are prefilled once. Nothing of the warm turn is reported and the prefix counters leave it out."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    instruction = tail(7, 40)
    for race in (False, True):
        core = EngineCore(eng)
        conv, warm_len = BASE[:37], 0
        for turn in range(3):
            prompt = conv + instruction
            got, rec, cached = run_turn(core, f"{race}-{turn}", prompt, 6, (len(conv), len(prompt)))
            assert cached == warm_len, (race, turn)
            want, frec = oracle(fresh, prompt, 6)
            assert got == want, (race, turn)
            assert_same(rec, frec, fresh)
            before = core.stats()
            core.add_warm(warm(f"{race}-{turn}:warm", conv + got))
            if not race:  # the gap between turns: the warm turn runs alone, reporting nothing
                while core.has_work:
                    assert core.step() == []
                stats = core.stats()
                assert stats["warm_turns"] == before["warm_turns"] + 1
                assert stats["warm_prefill_tokens"] - before["warm_prefill_tokens"] == len(got)  # from len(conv) on
                assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (
                    before["prefix_queried_tokens"], before["prefix_hit_tokens"])
            conv = conv + got + tail(11 + 5 * turn, 50 + turn)
            warm_len = len(conv) - len(tail(11 + 5 * turn, 50 + turn))
        if race:  # each next request waited for its warm turn (the last one is still queued), none was dropped
            assert core.stats()["warm_turns"] == 2 and core.stats()["warm_dropped"] == 0


def test_a_warm_turn_yields_to_requests(runtime_engine):
    """A warm turn is not admitted while a request waits, and gives its slot up to a request that needs it (one
    slot); that request's tokens are a full prefill's."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, num_slots=1, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    core = EngineCore(eng)
    other = tail(40, 80)
    core.add_warm(warm("w:warm", BASE[:90]))
    core.add(Request("other", other, SamplingParams(max_tokens=3, ignore_eos=True)))
    core.step()
    assert core.scheduler.running[0].request_id == "other" and not core.scheduler.warm_running
    while core.has_work:  # then the warm turn, in the slot "other" leaves
        core.step()
    assert core.stats()["warm_turns"] == 1
    # the warm turn now prefills in the only slot; a request arrives that does not continue it: it takes the slot
    core.add_warm(warm("v:warm", BASE[:60] + tail(30, 82)))
    core.step()
    assert "v:warm" in core.scheduler.warm_running
    got, rec, _ = run_turn(core, "next", other + tail(5, 81), 3, ())
    want, frec = oracle(fresh, other + tail(5, 81), 3)
    assert got == want
    assert_same(rec, frec, fresh)
    assert core.stats()["warm_dropped"] >= 1 and not core.scheduler.warm_running


def test_a_dropped_warm_turn_leaves_the_conversation_end_checkpoint(runtime_engine):
    """One slot: a turn ends; its warm turn resumes at the conversation's end (from the exact-position checkpoint
    there) and is dropped mid-prefill for a request that needs the slot. The next turn (conversation + output + tool
    answer + instruction) still resumes at the conversation's exact end, as on an engine without warm turns (not at
    the block boundary before it), with the tokens and logits of a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    conv, instruction, other = BASE[:37], tail(7, 40), tail(40, 80)
    assert len(conv) % fresh.block_size  # the conversation ends mid-block
    results = {}
    for warm_turn in (True, False):
        eng = Engine(engine_dir, num_slots=1, threads=1)
        eng.max_num_tokens = 8  # steps of 8 tokens: the warm turn's 30 take 4
        core = EngineCore(eng)
        got, _, _ = run_turn(core, "t0", conv + instruction, 30, (len(conv), len(conv) + len(instruction)))
        if warm_turn:
            core.add_warm(warm("t0:warm", conv + got))
            core.step()  # admitted, resuming at len(conv); its first chunk fed, not its last
            assert "t0:warm" in core.scheduler.warm_running
        run_turn(core, "other", other, 3, ())  # needs the only slot: the warm turn is dropped
        assert core.stats()["warm_dropped"] == int(warm_turn) and not core.scheduler.warm_running
        prompt = conv + got + tail(11, 50) + instruction
        results[warm_turn] = run_turn(core, "t1", prompt, 6, (len(prompt) - len(instruction), len(prompt)))
    want, frec = oracle(fresh, prompt, 6)
    for warm_turn, (got, rec, cached) in results.items():
        assert cached == len(conv), warm_turn
        assert got == want, warm_turn
        assert_same(rec, frec, fresh)


def test_a_request_departing_where_a_warm_turn_resumes_resumes_there_too(runtime_engine):
    """A warm turn resumes at the conversation's exact end (the exact-position checkpoint there) and, while it
    prefills, a request departing at that same point (the conversation + other tokens) arrives: it resumes there too
    (from a copy of the checkpoint's partial block, not at the block boundary before it); the next turn resumes at the
    warm turn's end. Every one has the tokens and logits of a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    eng.max_num_tokens = 8  # steps of 8 tokens: the warm turn's 30 take 4
    core = EngineCore(eng)
    conv, instruction = BASE[:37], tail(7, 40)  # the conversation ends mid-block (BS 16)
    got, _, _ = run_turn(core, "t0", conv + instruction, 30, (len(conv), len(conv) + len(instruction)))
    core.add_warm(warm("t0:warm", conv + got))
    core.step()  # admitted, resuming at len(conv); its first chunk fed, not its last
    assert "t0:warm" in core.scheduler.warm_running
    side = conv + tail(9, 63)
    side_got, side_rec, side_cached = run_turn(core, "side", side, 4, ())
    assert side_cached == len(conv) and core.stats()["warm_turns"] == 1 and core.stats()["warm_dropped"] == 0
    prompt = conv + got + tail(11, 50) + instruction
    nxt_got, nxt_rec, nxt_cached = run_turn(core, "t1", prompt, 6, (len(prompt) - len(instruction), len(prompt)))
    assert nxt_cached == len(conv) + len(got)  # the warm turn's end
    for p, n, tokens, rec in ((side, 4, side_got, side_rec), (prompt, 6, nxt_got, nxt_rec)):
        want, frec = oracle(fresh, p, n)
        assert tokens == want
        assert_same(rec, frec, fresh)


@pytest.fixture(scope="module")
def llms(runtime_engine):
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    warm_llm = LLM(engine_dir, threads=1, default_effort="low")
    cold = LLM(engine_dir, threads=1, default_effort="low", warm_turns=False)
    cacheless = LLM(engine_dir, threads=1, default_effort="low", prefix_caching=False, reuse_sessions=False)
    yield warm_llm, cold, cacheless
    for llm in (warm_llm, cold, cacheless):
        llm.shutdown()


def next_prompt_messages(api: str, messages: list[dict], out, answer: str = "rain all week") -> list[dict]:
    """The next request's messages (`messages` + this turn + the tool's `answer`) as each API's server turns them into
    chat messages: the assistant turn as the client sends it back (chat completions: the message as returned;
    Anthropic: the content blocks as returned; Responses: the stored message, `turn_ids` included)."""
    call = out.tool_calls[0]
    if api == "chat":
        assistant = {"role": "assistant", "content": out.content, "reasoning_content": out.reasoning_content,
                     "tool_calls": out.tool_calls}
        return messages + convert.chat_messages_from_openai([assistant, {"role": "tool", "tool_call_id": call["id"],
                                                                         "content": answer}])
    if api == "messages":
        return messages + convert.messages_from_anthropic(None, [
            {"role": "assistant", "content": convert.anthropic_content(out)},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": answer}]}])
    return messages + [out.message()] + convert.messages_from_responses_input(
        [{"type": "function_call_output", "call_id": call["id"], "output": answer}])


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_the_warm_prompt_is_the_next_prompts_prefix(llms, api):
    """The warm turn's prompt (`InputProcessor.next_turn_prompt`) is a proper prefix of the next request's prompt
    as the normal path renders it, longer than the conversation's end (it holds the model's output), for the
    history resent through chat completions and Anthropic messages and for a Responses chain."""
    llm = llms[0]
    messages = [{"role": "user", "content": "Is it warm in Rome this week?"}]
    rendered = llm.processor.render(messages, tools=WEATHER, tool_choice="required", reasoning_effort="low")
    (out,) = llm.chat([messages], SamplingParams(max_tokens=150), **REQUIRED)
    assert out.tool_calls
    ids = llm.processor.next_turn_prompt(rendered, out.message())
    nxt = llm.processor.render(next_prompt_messages(api, messages, out), tools=WEATHER, tool_choice="required",
                               reasoning_effort="low").prompt_ids
    assert len(ids) >= rendered.history_len + len(out.output_ids) and len(ids) < len(nxt)
    assert nxt[:len(ids)] == ids


def test_warm_turns_are_exact_and_can_be_turned_off(llms):
    """Two rounds of a forced (`required`) tool call, the history resent (the engine's 1,024 positions hold two): with
    warm turns round 2 resumes at the warm prompt's end (cached tokens = its length), without them at the
    conversation's end; greedy tokens and the logits of both rounds (round 2 resuming from the warm state) equal a
    cacheless engine's."""
    warm_llm, cold, cacheless = llms
    conversations = {}
    for name, llm in (("warm", warm_llm), ("cold", cold), ("cacheless", cacheless)):
        messages = [{"role": "user", "content": "Plan a week in Rome."}]
        rounds = []
        for k, max_tokens in enumerate((300, 24)):
            rendered = llm.processor.render(messages, **REQUIRED)
            rec = Recorder()
            (out,) = llm.chat([messages], SamplingParams(max_tokens=max_tokens), logits_processors=[rec], **REQUIRED)
            rounds.append((out, rec, rendered))
            if not k:
                assert out.tool_calls, name
                messages = next_prompt_messages("chat", messages, out, "rain, 14 C")
        conversations[name] = rounds
    for k in range(2):
        (w, wrec, _), (c, crec, _), (ref, rrec, _) = (conversations[n][k] for n in ("warm", "cold", "cacheless"))
        assert w.prompt_ids == ref.prompt_ids and w.output_ids == ref.output_ids == c.output_ids, k
        assert_same(wrec, rrec, warm_llm.engine)
        assert_same(crec, rrec, warm_llm.engine)
        assert ref.usage["cached_tokens"] == 0
    (first, _, rendered), (second, _, _) = conversations["warm"]
    warm_len = len(warm_llm.processor.next_turn_prompt(rendered, first.message()))
    assert second.usage["cached_tokens"] == warm_len >= rendered.history_len + len(first.output_ids)
    assert conversations["cold"][1][0].usage["cached_tokens"] == rendered.history_len
    assert warm_llm.stats()["warm_turns"] >= 1 and cold.stats()["warm_turns"] == 0

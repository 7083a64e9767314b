"""LLM / AsyncLLM: batched generate, thinking-budget tiers held exactly, parsed chat output, streaming
deltas that add up to the final output, abort, stop strings in text."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import OpensThink
from moe_export.common.errors import InputError
from moe_export.runtime.chat import parse_output, output_starts_in_reasoning
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.entrypoints.generate import generate_tokens
from moe_export.runtime.entrypoints.llm import LLM, AsyncLLM
from moe_export.runtime.sampling import SamplingParams

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-kimi-linear"])
def llm(request, runtime_engine):
    llm = LLM(runtime_engine(request.param, 2, 2, 4), threads=1)
    yield llm
    llm.shutdown()


def test_generate_batch_equals_alone(llm):
    prompts = ["Hello there", [5, 17, 99, 3], "A longer prompt about the weather in Paris."]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(p) if isinstance(p, str) else p
        assert out.prompt_ids == ids
        assert out.output_ids == generate_tokens(llm.engine, ids, params, sample_vocab=llm.tokenizer.vocab_size)
        assert out.text == llm.tokenizer.decode(out.output_ids) and out.finish_reason == "length"
        assert out.usage["completion_tokens"] == 7 and out.usage["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("effort, cap", [("low", 6), ("high", 12), ("max", 20), (3, 3)])
def test_each_tier_cap_holds_exactly(llm, effort, cap):
    tok = llm.tokenizer
    out = llm.chat([CONVERSATION], SamplingParams(max_tokens=40), reasoning_effort=effort,
                   logits_processors=[OpensThink(tok, llm.family)])[0]
    assert out.usage["reasoning_tokens"] == cap
    # the forced close marker follows the first `cap` reasoning tokens (K2: after the model's own <think>), and
    # the parse agrees with a whole parse
    if llm.family == "k3":
        start = 0
        marker = [tok.encode_special("<|close|>"), *tok.encode("think"), tok.encode_special("<|sep|>"),
                  tok.encode_special("<|open|>"), *tok.encode("response"), tok.encode_special("<|sep|>")]
    else:
        start = 1
        marker = [tok.encode_special("</think>")]
    assert out.output_ids[start + cap: start + cap + len(marker)] == marker
    whole = parse_output(tok, llm.family, out.output_ids, starts_in_reasoning=output_starts_in_reasoning(llm.family, True),
                         tools_declared=False)
    assert (out.reasoning_content, out.content) == (whole.reasoning_content, whole.content)


def test_effort_none_and_bad_effort(llm):
    out = llm.chat([CONVERSATION], SamplingParams(max_tokens=6), reasoning_effort="none")[0]
    assert out.usage["reasoning_tokens"] == 0 and out.reasoning_content is None
    with pytest.raises(InputError, match="reasoning effort"):
        llm.chat([CONVERSATION], reasoning_effort="medium-ish")


def test_stop_string_cuts_text(llm):
    free = llm.generate(["Hello there"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    text = free.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]


def test_async_streams_add_up_and_abort(llm):
    async def main():
        engine = AsyncLLM(llm)
        try:
            async def consume(stream):
                deltas = [d async for d in stream]
                return deltas

            params = SamplingParams(max_tokens=30, ignore_eos=True)
            streams = [engine.chat_stream(CONVERSATION, params, reasoning_effort="low", request_id="a",
                                          logits_processors=[OpensThink(llm.tokenizer, llm.family)]),
                       engine.generate_stream("Once upon a time", SamplingParams(max_tokens=9, ignore_eos=True), request_id="b")]
            a, b = await asyncio.gather(*(consume(s) for s in streams))
            for deltas in (a, b):
                out = deltas[-1].output
                assert deltas[-1].finished and sum(1 for d in deltas if d.finished) == 1
                assert [t for d in deltas for t in d.token_ids] == out.output_ids
                assert "".join(d.text for d in deltas) == out.text
            out_a = a[-1].output
            assert "".join(d.reasoning for d in a) == out_a.reasoning_content
            assert "".join(d.content for d in a) == (out_a.content or "")
            assert out_a.usage["reasoning_tokens"] == 6

            stream = engine.generate_stream("Abort me", SamplingParams(max_tokens=100, ignore_eos=True), request_id="c")
            first = await stream.__anext__()
            engine.abort("c")
            rest = [d async for d in stream]
            assert rest[-1].finished and rest[-1].output.finish_reason == "abort"
            assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 100
            assert engine.stats()["running"] == 0
            with pytest.raises(InputError, match="max_seq_len"):
                await engine.generate([1] * 1024)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_chat_terminal(runtime_engine, capsys, monkeypatch):
    """`moe-export chat`: streamed answers, /effort changes the cap, /reset clears, bad commands don't end it."""
    import io

    from conftest import run_cli

    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    script = "Hello.\n/effort low\nAnd now?\n/effort lots\n/nope\n/reset\nAgain.\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    rc, out, err = run_cli(capsys, "chat", str(engine_dir), "--max-tokens", "30", "--effort", "high")
    assert rc == 0, err
    usage = [line for line in out.splitlines() if line.startswith("(prompt ")]
    assert len(usage) == 3
    assert "reasoning 12;" in usage[0] and "reasoning 6;" in usage[1] and "reasoning 6;" in usage[2]
    assert "(thinking effort: low)" in out and "(conversation cleared)" in out
    assert "(error: reasoning effort must be" in out and "(unknown command /nope" in out
    prompts = [int(line.split()[1]) for line in usage]
    assert prompts[1] > prompts[0] + 30 and prompts[2] < prompts[1]  # history kept, then cleared
    rc, _, err = run_cli(capsys, "chat", str(engine_dir), "--effort", "medium")
    assert rc == 2 and "reasoning effort must be" in err


def test_chat_terminal_continues_the_kept_state(runtime_engine, capsys, monkeypatch):
    """`moe-export chat` sends each answer back as the tokens generated: turn 2 prefills only its new tokens."""
    import io

    from conftest import TextOnly, run_cli
    from moe_export.runtime.entrypoints import terminal

    class TextOnlyLLM(LLM):  # random weights: mask the reserved tokens no message can hold (see TextOnly)
        def chat_stream(self, messages, sampling=None, **kwargs):
            keep = {self.tokenizer.encode_special("<|end_of_msg|>")}
            return super().chat_stream(messages, sampling, logits_processors=[TextOnly(self.tokenizer, keep)], **kwargs)

    monkeypatch.setattr(terminal, "LLM", TextOnlyLLM)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\nAnd now?\n/exit\n"))
    rc, out, err = run_cli(capsys, "chat", str(runtime_engine("tiny-k3", 2, 2, 4)), "--max-tokens", "20", "--effort", "low")
    assert rc == 0, err
    (p1, c1, n1), (p2, c2, _) = [(int(w[1]), int(w[3]), int(w[-2].rstrip(";"))) for w in
                                 (line.split() for line in out.splitlines() if line.startswith("(prompt "))]
    assert c1 == 0 and c2 == p1 + n1 - 1 and p2 > c2


def test_chat_terminal_under_mpiexec(runtime_engine):
    """`mpiexec -n 4 moe-export chat`: rank 0 reads the terminal, ranks 1-3 follow its steps, all exit."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    cli = str(Path(sys.executable).parent / "moe-export")
    r = subprocess.run([mpiexec, "-n", "4", cli, "chat", str(engine_dir), "--max-tokens", "12", "--effort", "low"],
                       input="Hi!\nMore?\n/exit\n", capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    usage = [line for line in r.stdout.splitlines() if line.startswith("(prompt ")]
    assert len(usage) == 2 and all("reasoning 6;" in line for line in usage), r.stdout


class Force:
    """Logits processor writing `script` (one id per output position, forced budget markers included)."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[self.script[len(ids)]] = 0.0
        return out


def _stream(llm, messages, script, **kwargs) -> tuple[list, object]:
    """Run one chat (or, with messages None, a generation of `kwargs['prompt']`) streaming: (deltas, output)."""
    async def main():
        engine = AsyncLLM(llm)
        try:
            params = SamplingParams(max_tokens=kwargs.pop("max_tokens", len(script)), stop=kwargs.pop("stop", ()))
            if messages is None:
                stream = engine.generate_stream(kwargs.pop("prompt"), params, logits_processors=[Force(script)])
            else:
                stream = engine.chat_stream(messages, params, logits_processors=[Force(script)], **kwargs)
            return [d async for d in stream]
        finally:
            engine.shutdown()

    deltas = asyncio.run(main())
    return deltas, deltas[-1].output


def _joined(deltas) -> tuple[str, str, str]:
    return "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


SPLIT_TEXT = "héllo wörld € 🙂 中文 with the end"


def test_streamed_text_equals_whole_with_split_characters_and_costs_o_new_tokens(llm):
    """Characters split across tokens: the deltas never show half a character, join to exactly the whole
    decode, and decoding a step costs O(its tokens), stop strings watched included (the old loop decoded the
    whole output every step). Detokenized once: each output token is decoded exactly once, for the stop check
    and the output alike (they each decoded it before)."""
    tok = llm.tokenizer
    script = list(SPLIT_TEXT.encode()) * 3  # byte tokens: every multi-byte character spans 2-4 tokens
    seen: list[int] = []
    whole_decode, stream_decode = tok._decode, tok._enc.decode_bytes

    def count(fn):
        def spy(ids, *a, **k):
            seen.append(len(ids))
            return fn(ids, *a, **k)
        return spy

    tok._decode, tok._enc.decode_bytes = count(whole_decode), count(stream_decode)
    try:
        deltas, out = _stream(llm, None, script, prompt="Hi", stop=("never seen",))
    finally:
        del tok._decode, tok._enc.decode_bytes
    assert out.output_ids == script and out.text == tok.decode(script) == SPLIT_TEXT * 3
    assert "".join(d.text for d in deltas) == out.text and not any("\ufffd" in d.text for d in deltas)
    assert sum(seen) == len(script), f"{sum(seen)} token decodes for {len(script)} tokens"


def test_chat_stream_equals_whole_output_and_ends_with_what_the_parser_held(llm):
    tok = llm.tokenizer
    # effort none: the output is content; it ends inside a 4-byte character: finish() releases U+FFFD
    cut = list("ok 🙂".encode())[:-2]
    deltas, out = _stream(llm, [{"role": "user", "content": "hi"}], cut, reasoning_effort="none")
    assert out.content == "ok \ufffd" and _joined(deltas) == (out.text, "", out.content)
    # an unfinished tool call (cut by max_tokens) is dropped at finish(): no markup reaches content
    if llm.family == "k3":
        call = [tok.encode_special("<|open|>"), *tok.encode("tools"), tok.encode_special("<|sep|>"),
                tok.encode_special("<|open|>"), *tok.encode('call tool="f" index="1"'), tok.encode_special("<|sep|>"),
                *tok.encode("x")]
    else:
        call = [tok.encode_special("<|tool_calls_section_begin|>"), tok.encode_special("<|tool_call_begin|>"),
                *tok.encode("functions.f:0"), tok.encode_special("<|tool_call_argument_begin|>"), *tok.encode('{"a"')]
    script = list(b"done ") + call
    deltas, out = _stream(llm, [{"role": "user", "content": "hi"}], script, reasoning_effort="none")
    assert out.tool_call_parse_failures == 1 and out.content == "done " and out.tool_calls == []
    assert _joined(deltas)[2] == out.content
    # reasoning split across tokens and closed by the budget, then content
    cap = llm.thinking_caps["low"]
    marker = ([tok.encode_special("<|close|>"), *tok.encode("think"), tok.encode_special("<|sep|>"),
               tok.encode_special("<|open|>"), *tok.encode("response"), tok.encode_special("<|sep|>")]
              if llm.family == "k3" else [tok.encode_special("</think>")])
    opens = [] if llm.family == "k3" else [tok.encode_special("<think>")]  # K2-Thinking opens reasoning itself
    script = opens + list("é€a".encode())[:cap] + marker + list(SPLIT_TEXT.encode())
    deltas, out = _stream(llm, [{"role": "user", "content": "hi"}], script, reasoning_effort="low")
    assert (out.reasoning_content, out.content) == ("é€a", SPLIT_TEXT)
    assert _joined(deltas) == (out.text, out.reasoning_content, out.content)
    assert not any("\ufffd" in d.reasoning + d.content for d in deltas)


@pytest.mark.parametrize("stop, want", [("wör", "héllo "), ("h the", "héllo wörld € 🙂 中文 wit"), ("€ 🙂", "héllo wörld ")])
def test_chat_stop_strings_cut_text_content_and_stream(llm, stop, want):
    """The output stops at a stop string (also one beginning inside a merged token, "th"): text and content
    end before it, streamed or whole, and the output names the stop string."""
    tok = llm.tokenizer
    script = tok.encode(SPLIT_TEXT)
    assert tok.decode(script) == SPLIT_TEXT and any(len(tok.decode([t])) > 1 for t in script)
    deltas, out = _stream(llm, [{"role": "user", "content": "hi"}], script, reasoning_effort="none",
                          stop=("never-seen", stop))
    assert out.finish_reason == "stop" and out.stop_string == stop
    assert out.text == out.content == want
    assert _joined(deltas) == (want, "", want)
    deltas, out = _stream(llm, None, script, prompt="Hi", stop=(stop,))
    assert out.text == "".join(d.text for d in deltas) == want and out.stop_string == stop


def test_seeded_sampling_same_alone_and_in_a_batch_unseeded_differs(llm):
    """A seeded request draws the same tokens alone and among others (the sampler's randomness is a function of
    the seed and the token's index); without a seed two runs differ."""
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=11, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Hello there"], seeded)[0].output_ids
    batched = llm.generate(["Something else entirely", "Hello there", [5, 17, 99]], seeded)
    assert batched[1].output_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [llm.generate(["Hello there"], unseeded)[0].output_ids for _ in range(2)]
    assert runs[0] != runs[1]


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER_PARAMS}}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer"],
                 "additionalProperties": False}


def test_llm_chat_enforces_a_forced_tool_call_and_a_json_schema(llm):
    """Random weights: only the engine core's grammar can make these outputs valid (LLM.chat, no server)."""
    import json

    import jsonschema

    greedy = SamplingParams(max_tokens=200)
    (call,) = llm.chat([CONVERSATION], greedy, tools=WEATHER, reasoning_effort="low",
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.finish_reason == "tool_calls" and call.grammar_completed
    (tc,) = call.tool_calls
    assert tc["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(tc["function"]["arguments"]), WEATHER_PARAMS)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    (out,) = llm.chat([CONVERSATION], greedy, reasoning_effort="low", response_format=fmt)
    assert out.grammar_completed and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.content), ANSWER_SCHEMA)


def test_an_engine_failure_is_an_internal_error_not_bad_input(runtime_engine):
    """A failing step ends its requests with RequestFailed, an InternalError (APIs: 500), never bad input."""
    from moe_export.common.errors import InternalError
    from moe_export.runtime.engine import open_engine

    class FailingRunner:  # the real runner, whose steps fail
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def sample(self, batch, sampling):
            raise RuntimeError("device lost")

    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    allm = AsyncLLM(LLM(engine_dir, runner=FailingRunner(open_engine(engine_dir, threads=1))))

    async def run():
        return await allm.generate("hi", SamplingParams(max_tokens=2))

    try:
        for _ in range(2):
            with pytest.raises(InternalError, match="device lost") as exc:
                asyncio.run(run())
            assert not isinstance(exc.value, InputError)
    finally:
        allm.shutdown()


def test_overlap_on_and_off_give_the_same_outputs(runtime_engine):
    """Overlap (the next model step runs in a worker thread while the host processes this step's outputs) changes
    no greedy token, stop string cut, max_tokens length or abort; with it the runner's next step has started
    before the caller sees this step's updates."""
    import threading
    import time

    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    prompts = ["Hello there", [5, 17, 99, 3], "A longer prompt about the weather in Paris."]
    params = [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=5),
              SamplingParams(max_tokens=12, ignore_eos=True, stop=(" ",))]
    outs = {}
    for overlap in (False, True):
        llm = LLM(engine_dir, threads=1, overlap=overlap)
        try:
            assert llm._root().engine_core.overlap is overlap
            outs[overlap] = [(o.output_ids, o.text, o.finish_reason, o.stop_string)
                             for p, s in zip(prompts, params) for o in llm.generate([p], s)]
            outs[overlap].append([(o.output_ids, o.text) for o in llm.generate(prompts, params[0])])
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]

    llm = LLM(engine_dir, threads=1, overlap=True)
    sched = llm._root().engine_core
    started, sample = [], llm.engine.sample

    def recording(batch, sampling):
        started.append(threading.current_thread().name)
        time.sleep(0.05)
        return sample(batch, sampling)

    llm.engine.sample = recording
    try:
        sched.add(Request("a", [5, 17, 99, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
        sched.add(Request("b", [7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True)))
        first = sched.step()  # the prefill step; the first decode step starts without another call
        deadline = time.monotonic() + 30
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(started) == 2 and all(name.startswith("moe-export-step") for name in started)
        assert {u.request_id for u in first} == {"a", "b"}
        assert sched.abort("b")  # while its next step runs: that step's token for it is dropped
        got = {}
        while sched.has_work:
            for u in sched.step():
                got.setdefault(u.request_id, []).append(u)
        assert [u.finish_reason for u in got["b"]] == ["abort"] and not got["b"][0].token_ids
        assert sum(len(u.token_ids) for u in got["a"]) == 5 and got["a"][-1].finish_reason == "length"
    finally:
        llm.engine.sample = sample
        llm.shutdown()

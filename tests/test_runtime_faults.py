"""Fault injection at the LLM / AsyncLLM level: a failure stays with the request that caused it (RequestFailed, its
slot and blocks freed, the next request gets the same tokens as on a clean engine); a runner that keeps failing,
or a broken scheduler, kills the engine core (EngineDead for every open and later request, healthy False)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from moe_export.common.errors import EngineDead, InputError, InternalError, RequestFailed
from moe_export.runtime.engine import open_engine
from moe_export.runtime.entrypoints.llm import LLM, AsyncLLM
from moe_export.runtime.sampling import FLOAT32_TINY, SamplingParams, SamplingValueError

PROMPT = list(range(5, 45))  # 40 tokens: 2 full 16-token blocks (prefix-cache checkpoints in its prefill)
OTHER = [7, 8, 9, 10, 11]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


class FlakyRunner:
    """The real runner, whose `sample` raises at the chosen calls (1-based, counted from the start)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0
        self.fail_at: set[int] = set()
        self.always = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, batch, sampling):
        self.calls += 1
        if self.always or self.calls in self.fail_at:
            raise RuntimeError(f"injected runner failure at step {self.calls}")
        return self.inner.sample(batch, sampling)


@pytest.fixture(scope="module")
def engine_dir(runtime_engine):
    return runtime_engine("tiny-k3", 2, 2, 4)


@pytest.fixture(scope="module")
def clean(engine_dir):
    """Greedy output ids of PROMPT and OTHER on a fresh engine with no faults."""
    llm = LLM(engine_dir, threads=1)
    try:
        return {tuple(p): o.output_ids for p, o in zip((PROMPT, OTHER), llm.generate([PROMPT, OTHER], GREEDY))}
    finally:
        llm.shutdown()


@pytest.fixture
def make_llm(engine_dir):
    made = []

    def make(overlap: bool = True) -> tuple[LLM, FlakyRunner]:
        runner = FlakyRunner(open_engine(engine_dir, threads=1))
        llm = LLM(engine_dir, runner=runner, overlap=overlap)
        made.append(llm)
        return llm, runner

    yield make
    for llm in made:
        llm.shutdown()


def assert_nothing_held(llm: LLM) -> None:
    """No request is left waiting or running, and every slot is free or a kept session's."""
    sched = llm._root().engine_core
    stats = sched.stats()
    assert stats["waiting"] == stats["running"] == 0
    assert len(sched.scheduler.resources.free_slots) + stats["kept_sessions"] == llm.engine.num_slots


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("failing_step", [1, 4], ids=["prefill", "decode"])
def test_a_runner_failure_fails_its_step_and_the_next_request_gets_the_same_tokens(make_llm, clean, overlap, failing_step):
    llm, runner = make_llm(overlap)
    runner.fail_at = {failing_step}
    with pytest.raises(RequestFailed, match=f"injected runner failure at step {failing_step}"):
        llm.generate([PROMPT], GREEDY)
    assert llm.healthy and llm.fatal_error is None
    assert_nothing_held(llm)
    outs = llm.generate([PROMPT, OTHER], GREEDY)
    assert [o.output_ids for o in outs] == [clean[tuple(PROMPT)], clean[tuple(OTHER)]]
    assert llm.generate([PROMPT], GREEDY)[0].output_ids == clean[tuple(PROMPT)]  # from the kept state / cached prefix
    assert_nothing_held(llm)


def test_a_poisoned_sampling_row_fails_that_request_only(make_llm, clean):
    """A request whose sampling row cannot be built (here a seed past 64 bits that slipped past validation) ends
    alone; the request sharing its steps gets its tokens."""
    llm, _ = make_llm()
    allm = AsyncLLM(llm)
    poisoned = SamplingParams(max_tokens=8, ignore_eos=True)
    object.__setattr__(poisoned, "seed", 1 << 70)

    async def main():
        return await asyncio.gather(allm.generate(PROMPT, poisoned), allm.generate(OTHER, GREEDY),
                                    return_exceptions=True)

    try:
        bad, good = run(main())
        assert isinstance(bad, RequestFailed) and "sampling row" in str(bad) and "seed" in str(bad)
        assert good.output_ids == clean[tuple(OTHER)]
        assert run(allm.generate(PROMPT, GREEDY)).output_ids == clean[tuple(PROMPT)]
        assert allm.healthy and allm.fatal_error is None
    finally:
        allm.shutdown()
    assert_nothing_held(llm)


def test_seeds_are_unsigned_64_bit_integers(make_llm):
    """Seeds up to 2^64 - 1 sample (deterministically); 2^64 and negative seeds are refused before the engine."""
    llm, _ = make_llm()
    for seed in (1 << 63, (1 << 64) - 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
        first, again = (llm.generate([OTHER], params)[0].output_ids for _ in range(2))
        assert first == again and len(first) == 6
    for seed in (1 << 64, -1):
        with pytest.raises(InputError, match="unsigned 64-bit"):
            SamplingParams(seed=seed)
    assert llm.healthy


class ExplodingGrammar:
    """A grammar processor (the `fill_bitmask` interface of `core.structured`) that fails at its n-th row."""

    bitmask_width = 8

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def fill_bitmask(self, output_ids, row) -> bool:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("the grammar matcher broke")
        return False  # not constraining

    def __call__(self, output_ids, logits):
        return logits


@pytest.mark.parametrize("processor", ["grammar", "logits_processor"])
def test_a_grammar_or_logits_processor_failure_fails_that_request_only(make_llm, clean, processor):
    llm, _ = make_llm()
    allm = AsyncLLM(llm)

    def broken(output_ids, logits):
        if len(output_ids) == 2:
            raise ValueError("the logits processor broke")
        return logits

    procs = [ExplodingGrammar(3)] if processor == "grammar" else [broken]

    async def main():
        return await asyncio.gather(allm.generate(PROMPT, GREEDY, logits_processors=procs),
                                    allm.generate(OTHER, GREEDY), return_exceptions=True)

    try:
        bad, good = run(main())
        assert isinstance(bad, RequestFailed) and "broke" in str(bad)
        assert good.output_ids == clean[tuple(OTHER)]
        assert run(allm.generate(PROMPT, GREEDY)).output_ids == clean[tuple(PROMPT)]
        assert allm.healthy
    finally:
        allm.shutdown()
    assert_nothing_held(llm)


def test_a_detokenizer_failure_fails_that_request_only(make_llm, clean):
    """The core's incremental decoder of one request raises at its third token: that request ends, the one
    sharing its steps does not."""
    llm, _ = make_llm()
    sched = llm._root().engine_core
    make_decoder, made = sched.scheduler.text_decoder, []

    class Broken:
        def __init__(self, inner):
            self.inner, self.pushed = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def push(self, ids):
            self.pushed += 1
            if self.pushed == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return self.inner.push(ids)

    def first_one_broken():
        made.append(None)
        return Broken(make_decoder()) if len(made) == 1 else make_decoder()

    sched.scheduler.text_decoder = first_one_broken
    allm = AsyncLLM(llm)

    async def main():
        return await asyncio.gather(allm.generate(PROMPT, GREEDY), allm.generate(OTHER, GREEDY),
                                    return_exceptions=True)

    try:
        bad, good = run(main())
        assert isinstance(bad, RequestFailed) and "could not be decoded" in str(bad)
        assert good.output_ids == clean[tuple(OTHER)]
        assert run(allm.generate(PROMPT, GREEDY)).output_ids == clean[tuple(PROMPT)]
    finally:
        allm.shutdown()
    assert_nothing_held(llm)


def test_an_output_parser_failure_fails_that_request_only(make_llm):
    """The chat output stage (tokenizer-backed parser) of one request raises: that request ends and its slot is
    freed; a chat beside it and a chat after it answer."""
    llm, _ = make_llm()
    allm = AsyncLLM(llm)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    params = SamplingParams(max_tokens=6)
    want = llm.chat([chat], params, reasoning_effort="none")[0].output_ids
    broken = llm.prepare_chat(chat, params, reasoning_effort="none")

    def feed(ids):
        raise KeyError("token id unknown to the tokenizer")

    broken.parser.feed = feed

    async def collect(stream):
        async for delta in stream:
            if delta.finished:
                return delta.output

    async def main():
        return await asyncio.gather(collect(allm.stream(broken)),
                                    allm.chat(chat, params, reasoning_effort="none"), return_exceptions=True)

    try:
        bad, good = run(main())
        assert isinstance(bad, RequestFailed) and "could not be processed" in str(bad)
        assert good.output_ids == want
        assert run(allm.chat(chat, params, reasoning_effort="none")).output_ids == want
    finally:
        allm.shutdown()
    assert_nothing_held(llm)


def test_a_runner_that_keeps_failing_kills_the_engine(make_llm):
    """Each failed step fails its requests; after 3 in a row the core is dead: the open stream and every later
    request end with EngineDead, `healthy` is False and `fatal_error` says why, on LLM and AsyncLLM alike."""
    llm, runner = make_llm()
    runner.always = True
    allm = AsyncLLM(llm)
    try:
        for _ in range(2):
            with pytest.raises(RequestFailed):
                run(allm.generate(OTHER, GREEDY))
            assert allm.healthy and llm.healthy
        with pytest.raises(EngineDead, match="3 engine steps in a row failed") as dead:
            run(allm.generate(OTHER, GREEDY))
        assert isinstance(dead.value, InternalError) and not isinstance(dead.value, RequestFailed)
        assert not allm.healthy and not llm.healthy
        assert allm.fatal_error is llm.fatal_error is dead.value
        runner.always = False  # a dead core stays dead
        with pytest.raises(EngineDead):
            run(allm.generate(OTHER, GREEDY))
        with pytest.raises(EngineDead):
            llm.generate([OTHER], GREEDY)
    finally:
        allm.shutdown()


def test_a_broken_scheduler_kills_the_engine_at_once(make_llm):
    """An exception out of the scheduler itself (an invariant broken) is no request's fault: the core is dead
    at once and the open requests end with EngineDead."""
    llm, _ = make_llm(overlap=False)
    sched = llm._root().engine_core

    def broken_plan(resets, restores):
        raise AssertionError("two sequences hold one slot")

    sched.scheduler._plan = broken_plan
    with pytest.raises(EngineDead, match="two sequences hold one slot"):
        llm.generate([OTHER, PROMPT], GREEDY)
    assert not llm.healthy and isinstance(llm.fatal_error, EngineDead)
    with pytest.raises(EngineDead):
        llm.generate([OTHER], GREEDY)


def test_under_mpiexec_a_dead_core_releases_the_follower_ranks(engine_dir):
    """mpiexec -n 4: rank 0's core dies (its scheduler breaks before a step is broadcast); the followers leave
    `run_follower()` instead of waiting in the broadcast forever, and every rank exits."""
    import json
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    script = Path(__file__).with_name("mpi_dead_core_run.py")
    r = subprocess.run([mpiexec, "-n", "4", sys.executable, str(script), str(engine_dir)], capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("released") == 3, r.stdout  # (the ranks' lines may interleave)
    root = json.loads(re.search(r"\{.*?\}", r.stdout).group())
    assert root == {"error": "EngineDead", "later": "EngineDead", "healthy": False}


@pytest.mark.parametrize("field, value, says", [
    ("top_k", 1 << 63, "64-bit integer range"), ("top_k", -1, ">= 0"), ("top_k", 2.5, "an integer"),
    ("max_tokens", 1 << 64, "64-bit integer range"), ("top_p", 0.0, "(0, 1]"), ("top_p", float("nan"), "finite"),
    ("temperature", float("inf"), "finite"), ("temperature", 1e39, "float32"), ("min_p", float("nan"), "finite"),
    ("repetition_penalty", 1e-300, "> 0"), ("repetition_penalty", float("inf"), "finite"),
    ("stop_token_ids", (1 << 63,), "64-bit integer range"), ("logit_bias", {5: 1e300}, "float32"),
    ("logit_bias", {1 << 64: 1.0}, "64-bit integer range"), ("logit_bias", {"x": 1.0}, "map token ids"),
])
def test_sampling_values_are_validated_once_naming_the_field(field, value, says):
    """SamplingParams is the one validator every entry point builds its requests with: each integer within int64,
    each float finite and within float32 (the runner's tensors); the error names the field."""
    with pytest.raises(SamplingValueError) as bad:
        SamplingParams(**{field: value})
    assert bad.value.field == field and str(bad.value).startswith(field) and says in str(bad.value)
    assert isinstance(bad.value, InputError)


def test_sampling_values_at_the_edges_sample_and_never_hurt_the_engine(make_llm):
    """Values the validator lets through, at their edges, through the real sampler: top_k at or above the vocabulary
    keeps every token (the same draws as no top-k), top_p below float32's range is its smallest normal (the most likely
    token: greedy), and extreme temperatures, penalties and biases either sample or fail their request alone."""
    llm, _ = make_llm()
    vocab = llm.vocab_size
    base = SamplingParams(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    free = llm.generate([OTHER], base)[0].output_ids
    for top_k in (vocab, vocab + 1, (1 << 63) - 1):
        assert llm.generate([OTHER], replace(base, top_k=top_k))[0].output_ids == free, top_k
    tiny = SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=4, ignore_eos=True)
    assert tiny.top_p == FLOAT32_TINY
    assert llm.generate([OTHER], tiny)[0].output_ids == llm.generate([OTHER], GREEDY)[0].output_ids[:4]
    edges = [dict(temperature=1e-30), dict(temperature=3e38), dict(min_p=1.0), dict(top_k=1, top_p=FLOAT32_TINY),
             dict(repetition_penalty=FLOAT32_TINY), dict(repetition_penalty=3e38), dict(logit_bias={5: 3e38}),
             dict(logit_bias={5: -3e38, 6: 3e38}), dict(presence_penalty=2.0, frequency_penalty=-2.0)]
    for edge in edges:
        try:
            out = llm.generate([OTHER], replace(base, **edge))[0].output_ids
            assert len(out) == 4 and all(0 <= t < vocab for t in out), edge
        except RequestFailed:  # a value the sampler cannot choose from fails its request, nothing else
            pass
        assert llm.healthy and llm._root().engine_core.failed_steps == 0, edge
        assert llm.generate([OTHER], base)[0].output_ids == free, edge
    assert_nothing_held(llm)


def test_a_sampler_failure_fails_its_requests_not_the_step_or_the_engine(make_llm, clean, monkeypatch):
    """The sampler raising (after the step ran) fails the requests it was choosing for, as request failures: the
    step counts as run (no failed step toward EngineDead, so a client cannot kill the engine with it), and the next
    request gets the tokens of a clean engine."""
    from moe_export.runtime.engine import runner as runner_module

    llm, _ = make_llm()
    real, calls = runner_module.sample, []

    def failing(logits, sb):
        calls.append(1)
        if len(calls) == 2:  # the first decode step
            raise RuntimeError("selected index k out of range")
        return real(logits, sb)

    monkeypatch.setattr(runner_module, "sample", failing)
    for _ in range(4):  # more than max_failed_steps
        calls.clear()
        with pytest.raises(RequestFailed, match="choosing its token failed: RuntimeError: selected index k"):
            llm.generate([PROMPT], GREEDY)
        assert llm.healthy and llm._root().engine_core.failed_steps == 0
    monkeypatch.setattr(runner_module, "sample", real)
    assert llm.generate([PROMPT], GREEDY)[0].output_ids == clean[tuple(PROMPT)]
    assert_nothing_held(llm)

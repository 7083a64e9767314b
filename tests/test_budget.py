"""Thinking budgets: tier resolution, and the reasoning-budget enforcer on scripted token streams
(the runtime's end-to-end cap tests run it inside the scheduler)."""

from __future__ import annotations

import pytest
from moe_export.common.errors import InputError
from moe_export.runtime.chat import OutputParser
from moe_export.runtime.core.budget import (
    ReasoningBudget,
    ThinkingPlan,
    resolve_thinking,
)

CAPS = {"low": 64, "high": 256, "max": 512}


def test_resolve_thinking():
    assert resolve_thinking("low", CAPS, "max") == ThinkingPlan(True, 64, "low")
    assert resolve_thinking(None, CAPS, "max") == ThinkingPlan(True, 512, "max")
    assert resolve_thinking(None, CAPS, "none") == ThinkingPlan(False, None, "none")
    assert resolve_thinking("none", CAPS, "high") == ThinkingPlan(False, None, "none")
    assert resolve_thinking(100, CAPS, "max") == ThinkingPlan(True, 100, "high")
    assert resolve_thinking("64", CAPS, "max") == ThinkingPlan(True, 64, "low")
    assert resolve_thinking(0, CAPS, "max") == ThinkingPlan(True, 0, "low")
    assert resolve_thinking(10_000, CAPS, "max") == ThinkingPlan(True, 10_000, "max")
    assert resolve_thinking("high", {}, "max") == ThinkingPlan(True, None, "high")  # no caps: unlimited
    for bad in ("medium", -1, True, 1.5):
        with pytest.raises(InputError, match="effort|budget"):
            resolve_thinking(bad, CAPS, "max")
    with pytest.raises(InputError, match="default thinking effort"):
        resolve_thinking(None, CAPS, "extreme")


def run(budget: ReasoningBudget, script: list[int], steps: int) -> tuple[list[int], list[bool]]:
    """Drive `budget` like the runtime: forced token if any, else the script's next token."""
    emitted, forced = [], []
    it = iter(script)
    for _ in range(steps):
        f = budget.forced_token()
        t = f if f is not None else next(it)
        forced.append(f is not None)
        budget.observe(t)
        emitted.append(t)
    return emitted, forced


def k3_close(tok):
    s = tok.encode_special
    return [s("<|close|>"), *tok.encode("think"), s("<|sep|>"), s("<|open|>"), *tok.encode("response"), s("<|sep|>")]


@pytest.mark.parametrize("family", ["k3", "k2"])
@pytest.mark.parametrize("cap", [0, 1, 5, 64])
def test_cap_forces_the_whole_close_marker(toks, family, cap):
    tok = toks[family]
    text = tok.encode("x") * 200
    budget = ReasoningBudget(tok, family, cap, starts_in_reasoning=True)
    marker = k3_close(tok) if family == "k3" else [tok.encode_special("</think>")]
    emitted, forced = run(budget, text, cap + len(marker) + 5)
    assert emitted[cap:cap + len(marker)] == marker
    assert forced == [False] * cap + [True] * len(marker) + [False] * 5
    assert budget.reasoning_tokens == cap and not budget.in_reasoning
    parsed = OutputParser(tok, family, starts_in_reasoning=True)
    parsed.feed(emitted)
    msg = parsed.finish()
    assert msg.reasoning_content == ("x" * cap or None) and msg.content == "x" * 5


def test_k3_marker_the_model_began_is_completed_not_restarted(toks):
    tok = toks["k3"]
    s = tok.encode_special
    x = tok.encode("x")[0]
    script = [x, x, x, s("<|close|>"), tok.encode("th")[0]] + [x] * 50
    budget = ReasoningBudget(tok, "k3", 5, starts_in_reasoning=True)
    emitted, forced = run(budget, script, 5 + 10)
    rest = [*tok.encode("ink"), s("<|sep|>"), s("<|open|>"), *tok.encode("response"), s("<|sep|>")]
    assert emitted[:5] == script[:5] and emitted[5:5 + len(rest)] == rest
    assert emitted.count(s("<|close|>")) == 1
    assert budget.reasoning_tokens == 3 and not budget.in_reasoning  # the close tag is not reasoning
    # a close tag of something else is not the marker: the whole marker follows it
    other = [x, s("<|close|>"), *tok.encode("foo")] + [x] * 50
    budget = ReasoningBudget(tok, "k3", 3, starts_in_reasoning=True)
    emitted, _ = run(budget, other, 3 + len(k3_close(tok)))
    assert emitted[3:] == k3_close(tok) and budget.reasoning_tokens == 3


def test_k3_model_closes_itself_and_reopens(toks):
    tok = toks["k3"]
    s = tok.encode_special
    x = tok.encode("x")[0]
    close = [s("<|close|>"), *tok.encode("think"), s("<|sep|>")]
    reopen = [s("<|open|>"), *tok.encode("think"), s("<|sep|>")]
    script = [x, x] + close + [x, x, x] + reopen + [x] * 20
    budget = ReasoningBudget(tok, "k3", 6, starts_in_reasoning=True)
    marker = k3_close(tok)
    before = 2 + len(close) + 3 + len(reopen) + 4  # 2 + 4 reasoning tokens reach the cap
    emitted, forced = run(budget, script, before + len(marker))
    assert forced == [False] * before + [True] * len(marker)
    assert emitted[before:] == marker
    assert budget.reasoning_tokens == 6 and not budget.in_reasoning


def test_reasoning_state_follows_the_newest_marker_only(toks):
    """Output that starts outside reasoning (thinking off, or K2 without <think> in the prompt) is never
    capped until the model itself opens a think block; past turns' markers are not seen at all."""
    tok = toks["k2"]
    s = tok.encode_special
    x = tok.encode("x")[0]
    budget = ReasoningBudget(tok, "k2", 2, starts_in_reasoning=False)
    emitted, forced = run(budget, [x] * 5 + [s("<think>")] + [x] * 10, 10)
    assert forced == [False] * 8 + [True, False]
    assert emitted[8] == s("</think>") and budget.reasoning_tokens == 2
    # the tool-call section ends K2 reasoning implicitly
    budget = ReasoningBudget(tok, "k2", 5, starts_in_reasoning=True)
    run(budget, [x, s("<|tool_calls_section_begin|>")] + [x] * 10, 8)
    assert not budget.in_reasoning and budget.reasoning_tokens == 1


def test_no_cap_and_runtime_deviation(toks):
    tok = toks["k3"]
    x = tok.encode("x")[0]
    budget = ReasoningBudget(tok, "k3", None, starts_in_reasoning=True)
    _, forced = run(budget, [x] * 100, 100)
    assert not any(forced) and budget.reasoning_tokens == 100
    budget = ReasoningBudget(tok, "k3", 1, starts_in_reasoning=True)
    budget.observe(x)
    first = budget.forced_token()
    assert first == tok.encode_special("<|close|>") == budget.forced_token()  # asking twice does not advance
    budget.observe(x)  # the runtime emitted something else (e.g. a stop): the plan restarts from the new state
    assert budget.forced_token() == first and budget.reasoning_tokens == 2
    with pytest.raises(InputError, match="family"):
        ReasoningBudget(tok, "k9", 1, starts_in_reasoning=True)


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_random_streams_never_exceed_the_cap(toks, family):
    """Random token soup with think markers mixed in: the count never passes the cap, and every forced
    marker leaves the parser out of reasoning (it agrees with the budget on where reasoning ended)."""
    import random

    tok = toks[family]
    s = tok.encode_special
    if family == "k3":
        pieces = [[s("<|close|>")], [s("<|open|>")], [s("<|sep|>")], tok.encode("think"), tok.encode("th"), tok.encode("ink"), tok.encode("response")]
    else:
        pieces = [[s("<think>")], [s("</think>")], [s("<|tool_calls_section_begin|>")]]
    pieces += [tok.encode(" word"), tok.encode("x"), [s("[EOS]")]]
    rng = random.Random(1)
    for trial in range(200):
        cap = rng.randint(0, 12)
        script = [t for _ in range(200) for t in rng.choice(pieces)]
        starts = trial % 3 != 0
        budget = ReasoningBudget(tok, family, cap, starts_in_reasoning=starts)
        parser = OutputParser(tok, family, starts_in_reasoning=starts)
        it = iter(script)
        for _ in range(120):
            f = budget.forced_token()
            t = f if f is not None else next(it)
            budget.observe(t)
            parser.feed([t])
            assert budget.reasoning_tokens <= cap
            if f is not None and budget.forced_token() is None:  # a forced marker just completed
                assert not budget.in_reasoning and parser.channel != "reasoning"


@pytest.mark.parametrize("family", ["k3", "k2"])
@pytest.mark.parametrize("cap", [0, 1, 3, 9, None])
def test_may_force_next_is_never_wrong(toks, family, cap):
    """The scheduler plans a step ahead only when `may_force_next()` is False: then no token is forced now, nor
    after any next token (think markers, begun close tags, plain text), so the row planned ahead is right."""
    import copy
    import random

    tok = toks[family]
    s = tok.encode_special
    if family == "k3":
        vocab = [s("<|open|>"), s("<|close|>"), s("<|sep|>"), *tok.encode("think"), *tok.encode("th"),
                 *tok.encode("x"), *tok.encode("response")]
    else:
        vocab = [s("<think>"), s("</think>"), s("<|tool_calls_section_begin|>"), *tok.encode("x")]
    rng = random.Random(7)
    quiet_states = 0
    for trial in range(30):
        budget = ReasoningBudget(tok, family, cap, starts_in_reasoning=trial % 2 == 0)
        for _ in range(40):
            if not budget.may_force_next():
                quiet_states += 1
                for nxt in vocab:
                    probe = copy.copy(budget)
                    probe._queue, probe._tag = list(budget._queue), list(budget._tag) if budget._tag else None
                    assert probe.forced_token() is None
                    probe.observe(nxt)
                    assert probe.forced_token() is None, (trial, nxt)
            forced = budget.forced_token()
            budget.observe(forced if forced is not None else rng.choice(vocab))
    assert quiet_states > 100 if cap is None or cap > 1 else quiet_states == 0  # a cap of 0 or 1 is always near

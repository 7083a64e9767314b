"""A request that names its session (`Request.session`: OpenAI's `prompt_cache_key` / `user`, Anthropic's
`metadata.user_id`, read by the one request parser) keeps its prefix-cache checkpoints as an agent session's from its
first round: they outlive an anonymous request's under pressure (`core.prefix_cache`)."""

from __future__ import annotations

import asyncio

import pytest
from fake_llm import FakeLLM
from test_checkpoint_budget import cached_tokens, tail
from test_serve_faults import make_app

from moe_export.common.errors import InputError


def test_a_named_sessions_checkpoints_outlive_an_anonymous_ones(runtime_engine):
    """A pool of 4 checkpoints: a named session's one-round request, then an anonymous one, fill it; a third
    request's two checkpoints evict the anonymous request's (a one-turn lineage), not the named session's, though
    the named one is older. Its next round resumes at 64; the anonymous prompt's does not."""
    from moe_export.runtime.core.engine_core import EngineCore
    from moe_export.runtime.engine.ort import Engine

    eng = Engine(runtime_engine("tiny-k3", 2, 2, 4), num_slots=2, num_checkpoints=4, threads=1)
    core = EngineCore(eng, keep_sessions=False)
    named, anonymous = tail(70, 20), tail(70, 21)
    assert cached_tokens(core, "agent-round-1", named + tail(20, 22), session="agent-7") == 0
    assert cached_tokens(core, "anonymous", anonymous + tail(20, 23)) == 0
    assert cached_tokens(core, "pressure", tail(90, 24)) == 0
    assert core.stats()["prefix_checkpoints"] == 4
    assert cached_tokens(core, "agent-round-2", named + tail(25, 25), session="agent-7") == 64
    assert cached_tokens(core, "anonymous-again", anonymous + tail(25, 26)) == 0


@pytest.mark.parametrize("options, session", [
    ({"user": "u-1"}, "u-1"), ({"prompt_cache_key": "agent-7", "user": "u-1"}, "agent-7"), ({}, None),
    ({"user": None}, None)])
def test_the_request_parser_reads_the_session(options, session):
    from moe_export.runtime.request_options import parse_request_options
    from moe_export.runtime.sampling import SamplingParams

    assert parse_request_options(options, SamplingParams()).session == session


@pytest.mark.parametrize("value", ["", 7, "x" * 257, ["a"]])
def test_a_bad_session_key_is_refused_naming_it(value):
    from moe_export.runtime.request_options import parse_request_options
    from moe_export.runtime.sampling import SamplingParams

    with pytest.raises(InputError, match=r"sampling_parameters: user must be a string of 1 to 256 characters"):
        parse_request_options({"user": value}, SamplingParams(), where="sampling_parameters")


def test_the_served_apis_pass_the_session_to_the_engine_request(tmp_path):
    """The official clients' fields reach `Tracked.session`: chat completions and Responses `prompt_cache_key` (over
    `user`) and `user`, legacy completions `user` (each of its choices), Anthropic messages `metadata.user_id`; none:
    anonymous; a bad one is a 400 naming it."""
    import anthropic
    import httpx
    import httpx2  # (the anthropic client's fork of httpx)
    import openai

    llm = FakeLLM()
    app, _ = make_app(tmp_path, llm)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", max_retries=0, http_client=http)
        ant = anthropic.AsyncAnthropic(base_url="http://t", api_key="k", max_retries=0, http_client=httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://t"))
        messages = [{"role": "user", "content": "hi"}]
        await oai.chat.completions.create(model="m", messages=messages, max_tokens=2, prompt_cache_key="agent-7", user="u-1")
        await oai.chat.completions.create(model="m", messages=messages, max_tokens=2, user="u-1")
        await oai.chat.completions.create(model="m", messages=messages, max_tokens=2)
        await oai.responses.create(model="m", input="hi", max_output_tokens=2, prompt_cache_key="agent-8")
        await oai.responses.create(model="m", input="hi", max_output_tokens=2, user="u-2")
        await ant.messages.create(model="m", messages=messages, max_tokens=2, metadata={"user_id": "u-3"})
        await ant.messages.create(model="m", messages=messages, max_tokens=2)
        await oai.completions.create(model="m", prompt=["hi", "ho"], max_tokens=2, user="u-4")
        await oai.completions.create(model="m", prompt="hi", max_tokens=2)
        bad = [await http.post(route, json={**body, "max_tokens": 2, "user": ""}) for route, body in (
            ("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": "hi"}))]
        await http.aclose()
        return bad

    bad = asyncio.run(go())
    assert llm.sessions == ["agent-7", "u-1", None, "agent-8", "u-2", "u-3", None, "u-4", "u-4", None]
    assert all(b.status_code == 400 and "user must be a string" in b.text for b in bad)

"""`moe-export serve` on a live loopback server over a tiny random-weight K3 engine, driven by the official
`openai` and `anthropic` clients (unmodified) and raw httpx for protocol details.

Random weights never close reasoning by themselves, so each tier's cap is what ends it (usage shows the
cap exactly); grammar-constrained decoding is what makes forced tool calls and JSON formats parse.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from serve_support import SERVE_LIMITS, SERVE_THINKING, InProcessServer, build_serve_engine, start_cli_server, stop_process

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER_PARAMS}}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="session")
def serve_engine(tmp_path_factory):
    return build_serve_engine(tmp_path_factory.mktemp("serve-engine"))


@pytest.fixture(scope="session")
def server(serve_engine, tmp_path_factory):
    srv = InProcessServer(serve_engine, api_keys=(KEY_A, KEY_B), store_path=str(tmp_path_factory.mktemp("store") / "h.sqlite"),
                          default_effort="low", max_body_bytes=256 << 10, max_messages=64, max_tools=8,
                          served_model_names=("m", "m-alias"))
    yield srv
    srv.stop()


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_and_metrics(server, oai):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in oai.models.list().data] == ["m", "m-alias"] and server.settings.model_name == "m"
    assert oai.models.retrieve("m-alias").id == "m-alias"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # vLLM's answer to an unknown model
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert oai.chat.completions.create(model="m-alias", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2).model == "m-alias"
    assert httpx.get(f"{server.url}/version").json()["version"]
    oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("moe_export_requests_total", "moe_export_time_to_first_token_seconds_bucket", "moe_export_queue_depth",
                 "moe_export_cache_blocks_used", "moe_export_state_reuse_hits", "moe_export_reasoning_tokens_by_tier_total",
                 "moe_export_tool_call_parses_total", "moe_export_structured_output_failures_total"):
        assert name in text, name
    assert 'moe_export_requests_total{route="/v1/chat/completions",status="200"}' in text


def test_chat_plain_and_stream_agree(oai):
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    whole = oai.chat.completions.create(model="m", messages=messages, max_completion_tokens=14, **GREEDY)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    usage = whole.usage
    assert usage.completion_tokens == 14 and usage.completion_tokens_details.reasoning_tokens == SERVE_THINKING["low"]
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<|" not in reasoning and "<|" not in (msg.content or "")
    chunks = list(oai.chat.completions.create(model="m", messages=messages, max_completion_tokens=14, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_reasoning == reasoning and streamed_content == (msg.content or "")
    assert chunks[-1].usage.completion_tokens == 14 and chunks[-2].choices[0].finish_reason == "length"
    with_logprobs = oai.chat.completions.create(model="m", messages=messages, max_completion_tokens=14, logprobs=True, **GREEDY)
    entries = with_logprobs.choices[0].logprobs.content
    assert len(entries) == 14 and all(e.logprob <= 0 for e in entries)


@pytest.mark.parametrize("effort", ["low", "high", "max", "none"])
def test_each_tier_caps_reasoning(oai, effort):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think hard."}],
                                    reasoning_effort=effort, max_tokens=40, **GREEDY)
    reasoning_tokens = r.usage.completion_tokens_details.reasoning_tokens
    assert reasoning_tokens == (0 if effort == "none" else SERVE_THINKING[effort])
    if effort == "none":
        assert not r.choices[0].message.model_extra.get("reasoning_content")


def test_tool_call_round_trip_keeps_reasoning_verbatim(server, oai):
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = oai.chat.completions.create(model="m", messages=messages, tools=WEATHER, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning
    turn2 = messages + [
        {"role": "assistant", "content": choice.message.content, "reasoning_content": reasoning,
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    chunks = list(oai.chat.completions.create(model="m", messages=messages, tools=WEATHER, max_tokens=200, stream=True,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY))
    streamed_calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.id, tc.function.name) for tc in streamed_calls if tc.id] == [(0, call.id, call.function.name)]
    assert "".join(tc.function.arguments or "" for tc in streamed_calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    second = oai.chat.completions.create(model="m", messages=turn2, tools=WEATHER, max_tokens=20, **GREEDY)
    assert second.choices[0].finish_reason in ("stop", "length")
    prompt2 = tokenize(server, messages=turn2, tools=WEATHER)
    assert second.usage.prompt_tokens == len(prompt2)  # /tokenize renders what the runtime rendered
    from moe_export.runtime.tokenizer import load_tokenizer

    assert reasoning in load_tokenizer(server.settings.engine_dir).decode(prompt2)  # as generated: same text


def test_follow_up_turn_sent_back_as_text_continues_the_kept_state(server, oai):
    """An agent loop: turn 1 (reasoning + a forced tool call) comes back as text and re-encodes to other tokens
    than the model sampled; the server renders it as the generated tokens (same text and markers), so turn 2
    reuses the kept state; the same prompt again (turn 2's kept sequence is longer than it) resumes from the prefix
    cache's deepest checkpoint before its end, the exact one at turn 1's prompt end (a prompt ending at a turn point
    gets no checkpoint at its last block boundary: `runtime.core.prefix_cache`), with the same answer. (The call is
    forced by name: K3
    renders no message for that, while `required` adds one after the conversation, which the next prompt
    moves, so nothing would be reused.)"""
    from moe_export.runtime.chat import render_ids
    from moe_export.runtime.tokenizer import load_tokenizer

    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = {"tools": WEATHER, "tool_choice": named, "parallel_tool_calls": False, **GREEDY}
    messages = [{"role": "user", "content": "Weather for my Oslo trip?"}]
    first = oai.chat.completions.create(model="m", messages=messages, max_tokens=200, **forced)
    msg = first.choices[0].message
    (call,) = msg.tool_calls
    turn2 = messages + [
        {"role": "assistant", "content": msg.content, "reasoning_content": msg.model_extra["reasoning_content"],
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "snow"},
    ]
    tok = load_tokenizer(server.settings.engine_dir)
    served = tokenize(server, messages=turn2, tools=WEATHER, tool_choice=named)
    encoded = render_ids(tok, turn2, tools=WEATHER, tool_choice=named, thinking_effort="low")
    kept = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert encoded[:kept] != served[:kept]  # precondition: the reply does not re-encode to its tokens
    assert tok.decode(served) == tok.decode(encoded)
    assert [t for t in served if tok.is_special(t)] == [t for t in encoded if tok.is_special(t)]

    second = oai.chat.completions.create(model="m", messages=turn2, max_tokens=12, **forced)
    assert second.usage.prompt_tokens == len(served)
    assert second.usage.prompt_tokens_details.cached_tokens == kept
    again = oai.chat.completions.create(model="m", messages=turn2, max_tokens=12, **forced)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert again.choices[0].message == second.choices[0].message and again.usage == second.usage.model_copy(
        update={"prompt_tokens_details": again.usage.prompt_tokens_details})


def test_resent_history_continues_the_kept_state_every_turn(server, oai):
    """Three agent turns through chat completions, each resending the whole history with a forced tool call: K3 call
    ids count on across turns (`functions.NAME:1` in turn 2), settled before the turn is remembered, so each earlier
    assistant turn renders as its generated tokens and every turn continues the previous turn's kept state."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = {"tools": WEATHER, "tool_choice": named, "parallel_tool_calls": False, **GREEDY}
    messages = [{"role": "user", "content": "Weather for a week in Paris, then Rome?"}]
    prev = None
    for turn in range(3):
        r = oai.chat.completions.create(model="m", messages=messages, max_tokens=200, **forced)
        (call,) = r.choices[0].message.tool_calls
        assert call.id == f"functions.get_weather:{turn}"
        if prev is not None:
            assert r.usage.prompt_tokens_details.cached_tokens == prev.usage.prompt_tokens + prev.usage.completion_tokens - 1
        msg = r.choices[0].message
        messages = messages + [
            {"role": "assistant", "content": msg.content, "reasoning_content": msg.model_extra["reasoning_content"],
             "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": f"day {turn}: rain"},
        ]
        prev = r


def test_required_turn_resumes_where_the_conversation_ended(server, oai):
    """`tool_choice: "required"`: K3 renders its tool-choice message after the conversation, so the next turn's
    prompt (the history resent, the assistant's turn where that message was) departs from turn 1's prompt at the
    conversation's end, mid-block. Between the turns the server prefills the conversation and turn 1's output as
    turn 2 renders them (a warm turn, resuming at the checkpoint of that turn point), so turn 2 resumes after the
    model's own output; the warm prefill is counted by /metrics, not in the usage."""
    from moe_export.runtime.chat import render_prompt
    from moe_export.runtime.tokenizer import load_tokenizer

    required = {"tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False, **GREEDY}
    messages = [{"role": "user", "content": "Is it warm in Rome this week?"}]
    first = oai.chat.completions.create(model="m", messages=messages, max_tokens=200, **required)
    msg = first.choices[0].message
    (call,) = msg.tool_calls
    tok = load_tokenizer(server.settings.engine_dir)
    history = render_prompt(tok, messages, tools=WEATHER, tool_choice="required", thinking_effort="low")[1]
    assert history % server.llm.llm.engine.block_size  # precondition: the conversation ends mid-block
    turn2 = messages + [
        {"role": "assistant", "content": msg.content, "reasoning_content": msg.model_extra["reasoning_content"],
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "warm"},
    ]
    # the conversation and turn 1 as the server renders them back (turn 1 as its generated tokens: the turn memory)
    warm = len(server.llm.processor.render(turn2[:2], tools=WEATHER, reasoning_effort="low",
                                           add_generation_prompt=False).prompt_ids)
    second = oai.chat.completions.create(model="m", messages=turn2, max_tokens=12, **required)
    assert second.usage.prompt_tokens_details.cached_tokens == warm > history + first.usage.completion_tokens
    assert metric(server, "moe_export_warm_prefill_tokens_total") >= warm - history


def test_responses_chain_continues_the_kept_state(server, oai):
    """previous_response_id: the stored turn carries its generated tokens, and turn 2 reuses the kept state."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    forced = {"tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
              "temperature": 0}  # named, not `required`: K3's tool-choice message would follow the conversation
    r1 = oai.responses.create(model="m", input="Weather in Rome this week?", max_output_tokens=200, **forced)
    call = next(i for i in r1.output if i.type == "function_call")
    r2 = oai.responses.create(model="m", previous_response_id=r1.id, max_output_tokens=12, **forced,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    stored = sqlite3.connect(server.settings.store_path).execute(
        "SELECT output_message FROM responses WHERE id = ?", (r1.id,)).fetchone()[0]
    assert len(json.loads(stored)["turn_ids"]) > r1.usage.output_tokens


def test_json_schema_response_format_validates(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=80, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_completions_and_token_endpoints(server, oai):
    whole = oai.completions.create(model="m", prompt="Once upon a time", max_tokens=6, **GREEDY)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="m", prompt="Once upon a time", max_tokens=6,
                                                                        stream=True, **GREEDY))
    assert streamed == whole.choices[0].text
    ids = tokenize(server, prompt="typed <|open|> stays text")
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.json()["prompt"] == "typed <|open|> stays text"


def test_anthropic_messages_thinking_tools_and_stream(claude):
    msg = claude.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "hello"}],
                                 thinking={"type": "enabled", "budget_tokens": 5}, extra_body=GREEDY)
    assert msg.type == "message" and msg.content[0].type == "thinking"
    assert msg.usage.output_tokens == 16 and msg.stop_reason == "max_tokens"
    with claude.messages.stream(model="m", max_tokens=16, messages=[{"role": "user", "content": "hello"}],
                                thinking={"type": "enabled", "budget_tokens": 5}, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]

    tools = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER_PARAMS}]
    first = claude.messages.create(model="m", max_tokens=200, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER_PARAMS)
    second = claude.messages.create(model="m", max_tokens=10, tools=tools, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "snow"}]},
    ])
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_stop_sequence(claude):
    """A stop sequence ends the message before it: stop_reason "stop_sequence" and the matched string, whole
    and streamed."""
    base = {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "Count to ten."}],
            "thinking": {"type": "disabled"}, "extra_body": GREEDY}
    free = claude.messages.create(**base).content[0].text
    # a character split across byte tokens, never part of a marker's name in the raw text
    stop = next(c for c in free[3:] if not c.isascii() and c != "\ufffd")
    want = free[: free.index(stop)]
    assert len(want) >= 3
    msg = claude.messages.create(**base, stop_sequences=["never seen", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in msg.content if b.type == "text") == want
    with claude.messages.stream(**base, stop_sequences=["never seen", stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in msg.content]
    plain = claude.messages.create(**{**base, "max_tokens": 3})
    assert (plain.stop_reason, plain.stop_sequence) == ("max_tokens", None)


def test_responses_chain_equals_stateless_history(server, oai):
    opts = {"reasoning": {"effort": "low"}, "max_output_tokens": 12, "temperature": 0}
    r1 = oai.responses.create(model="m", input="Plan a trip to Rome.", **opts)
    assert r1.status == "incomplete" and [i.type for i in r1.output][0] == "reasoning"
    r2 = oai.responses.create(model="m", input="And then?", previous_response_id=r1.id, **opts)
    items1 = [i.model_dump(exclude_none=True) for i in r1.output]
    stateless = oai.responses.create(model="m", store=False, input=[
        {"role": "user", "content": "Plan a trip to Rome."}, *items1, {"role": "user", "content": "And then?"}], **opts)
    dropped = oai.responses.create(model="m", store=False, input=[
        {"role": "user", "content": "Plan a trip to Rome."}, *[i for i in items1 if i["type"] != "reasoning"],
        {"role": "user", "content": "And then?"}], **opts)
    assert [i.model_dump(exclude={"id"}) for i in r2.output] == [i.model_dump(exclude={"id"}) for i in stateless.output]
    assert r2.usage.input_tokens == stateless.usage.input_tokens != dropped.usage.input_tokens
    assert [i.model_dump(exclude={"id"}) for i in dropped.output] != [i.model_dump(exclude={"id"}) for i in r2.output]
    assert oai.responses.retrieve(r2.id).id == r2.id
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r2.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="x", previous_response_id=r2.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(stateless.id)  # store=False: never stored
    events = list(oai.responses.create(model="m", input="And then?", previous_response_id=r1.id, stream=True, **opts))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [i.model_dump(exclude={"id"}) for i in events[-1].response.output] == [i.model_dump(exclude={"id"}) for i in r2.output]
    oai.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r2.id)


def test_responses_function_call_output_round_trip(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    r1 = oai.responses.create(model="m", input="Weather?", tools=tools, max_output_tokens=200, temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"})
    call = next(i for i in r1.output if i.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    r2 = oai.responses.create(model="m", previous_response_id=r1.id, tools=tools, max_output_tokens=8, temperature=0,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > r1.usage.input_tokens


async def _one_conversation(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"conversation {i}: " + "ab" * i}],
                                             max_tokens=10, reasoning_effort="low", **GREEDY)
    m = r.choices[0].message
    return m.model_extra.get("reasoning_content") or "", m.content or ""


def test_16_concurrent_clients_equal_sequential_greedy(server):
    async def run(concurrent: bool):
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0) as client:
            if concurrent:
                return await asyncio.gather(*(_one_conversation(client, i) for i in range(16)))
            return [await _one_conversation(client, i) for i in range(16)]

    sequential = asyncio.run(run(False))
    assert asyncio.run(run(True)) == sequential
    assert len(set(sequential)) > 1


def test_auth_limits_and_error_shapes(server, serve_engine):
    url = server.url
    good = {"Authorization": f"Bearer {KEY_A}"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{url}/v1/messages", json={"model": "m", "messages": []}, headers={"x-api-key": KEY_A})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={**good, "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "x" * (300 << 10)}]},
                   headers=good)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "messages": chat["messages"] * 65}, headers=good)
    assert r.status_code == 400 and "limit of 64" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "tools": WEATHER * 9}, headers=good)
    assert r.status_code == 400 and "limit of 8" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 5000}, headers=good)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    long_prompt = {**chat, "messages": [{"role": "user", "content": "word " * 1200}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=long_prompt, headers=good)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"}, headers=good)
    assert r.status_code == 400 and "effort" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/responses/resp_nope", headers=good)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for r in (httpx.get(f"{url}/nowhere"), httpx.post(f"{url}/v1/chat/completions", json={"messages": 3}, headers=good)):
        assert "Traceback" not in r.text and "error" in r.json()


def test_full_queue_answers_429(server):
    old = server.settings.max_queue
    server.settings.max_queue = 1

    async def flood():
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 20, "reasoning_effort": "none"}
            return await asyncio.gather(*(client.post(f"{server.url}/v1/chat/completions", json=body,
                                                      headers={"Authorization": f"Bearer {KEY_A}"}) for _ in range(30)))

    try:
        codes = [r.status_code for r in asyncio.run(flood())]
    finally:
        server.settings.max_queue = old
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}


@pytest.mark.slow
def test_kill9_restart_continues_chain_and_sigterm_drains(serve_engine, tmp_path):
    store = tmp_path / "history.sqlite"
    args = [str(serve_engine), "--store", str(store), "--default-effort", "low", "--served-model-name", "m"]
    proc, url = start_cli_server(args, env={"MOE_EXPORT_API_KEY": KEY_A})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0)
    opts = {"max_output_tokens": 10, "temperature": 0}
    r1 = client.responses.create(model="m", input="First turn.", **opts)
    stream = iter(client.responses.create(model="m", input="Never finished.", stream=True, max_output_tokens=700,
                                          temperature=0, extra_body={"ignore_eos": True}))
    for _, event in zip(range(8), stream):  # mid-stream: a few deltas in, hundreds of tokens to go
        assert event.type != "response.completed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    rows = sqlite3.connect(store).execute("SELECT id FROM responses").fetchall()
    assert rows == [(r1.id,)]  # the killed response left no partial record

    proc, url = start_cli_server(args, env={"MOE_EXPORT_API_KEY": KEY_A})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0)
    r2 = client.responses.create(model="m", input="Second turn.", previous_response_id=r1.id, **opts)
    stateless = client.responses.create(model="m", store=False, input=[
        {"role": "user", "content": "First turn."}, *[i.model_dump(exclude_none=True) for i in r1.output],
        {"role": "user", "content": "Second turn."}], **opts)
    assert [i.model_dump(exclude={"id"}) for i in r2.output] == [i.model_dump(exclude={"id"}) for i in stateless.output]

    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120,
                      json={"model": "m", "messages": [{"role": "user", "content": "drain me"}], "max_tokens": 60,
                            "stream": True, "reasoning_effort": "none"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                if not chunks:
                    proc.send_signal(signal.SIGTERM)  # drain: this stream must still finish
                chunks.append(line)
    assert chunks[-1] == "data: [DONE]"
    assert proc.wait(60) == 0


@pytest.mark.slow
def test_mpiexec_4_ranks_serve_and_drain(tmp_path_factory, server):
    engine4 = build_serve_engine(tmp_path_factory.mktemp("serve-engine-4"), tp=2, ep=2, world=4)
    proc, url = start_cli_server([str(engine4), "--default-effort", "low", "--served-model-name", "m"], mpiexec_ranks=4)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 12, "temperature": 0}
        four = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json() for _ in range(2)]
        one = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}).json()
    finally:
        code = stop_process(proc)
    assert four[0]["choices"][0]["message"] == four[1]["choices"][0]["message"]
    assert four[0]["usage"]["completion_tokens"] == 12
    # same synthetic weights, other layout: the parity suite holds logits within 1e-4, so greedy text agrees
    assert four[0]["choices"][0]["message"] == one["choices"][0]["message"]
    assert code == 0


@pytest.fixture(scope="module")
def k2_server(tmp_path_factory):
    srv = InProcessServer(build_serve_engine(tmp_path_factory.mktemp("serve-k2"), preset="tiny-kimi-linear"),
                          default_effort="low", served_model_names=("m",))
    yield srv
    srv.stop()


def test_k2_family_forced_tool_call_and_json(k2_server):
    """tiny-kimi-linear speaks the K2 role-token format: the same requests work through its grammar."""
    client = openai.OpenAI(base_url=f"{k2_server.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=WEATHER,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=200, **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert r.usage.completion_tokens_details.reasoning_tokens == SERVE_THINKING["low"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                                       reasoning_effort="none", **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_bodies_validate_against_the_sdks_own_models(server):
    """Strict pydantic validation with the clients' own response types (the clients themselves parse leniently)."""
    from anthropic.types import Message
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    h = {"Authorization": f"Bearer {KEY_A}"}
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=h, timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0,
        "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False}).json()
    assert ChatCompletion.model_validate(chat).choices[0].message.tool_calls
    completion = httpx.post(f"{server.url}/v1/completions", headers=h, timeout=120,
                            json={"model": "m", "prompt": "a", "max_tokens": 3}).json()
    Completion.model_validate(completion)
    response = httpx.post(f"{server.url}/v1/responses", headers=h, timeout=120,
                          json={"model": "m", "input": "hi", "max_output_tokens": 8, "temperature": 0}).json()
    assert Response.model_validate(response).output[0].type == "reasoning"
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    message = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY_A}, timeout=120,
                         json={**body, "thinking": {"type": "enabled", "budget_tokens": 4}}).json()
    assert Message.model_validate(message).content[0].type == "thinking"
    # no `thinking` field: no reasoning (Anthropic's default), although the server's default effort is "low"
    plain = Message.model_validate(httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY_A}, timeout=120,
                                              json=body).json())
    assert plain.content and all(b.type == "text" for b in plain.content)


def sse_data(url: str, headers: dict, body: dict) -> list[dict]:
    with httpx.stream("POST", url, headers=headers, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    return [json.loads(d) for d in lines if d != "[DONE]"]


def test_stream_events_validate_against_the_sdks_own_models(server):
    from anthropic.types import RawMessageStreamEvent
    from openai.types.chat import ChatCompletionChunk
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    h = {"Authorization": f"Bearer {KEY_A}"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0,
            "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False}
    for chunk in sse_data(f"{server.url}/v1/chat/completions", h, chat):
        ChatCompletionChunk.model_validate(chunk)
    events = sse_data(f"{server.url}/v1/responses", h, {"model": "m", "input": "hi", "max_output_tokens": 12,
                                                        "temperature": 0, "reasoning": {"effort": "low"}})
    kinds = [TypeAdapter(ResponseStreamEvent).validate_python(e).type for e in events]
    assert kinds[0] == "response.created" and "response.reasoning_text.delta" in kinds
    events = sse_data(f"{server.url}/v1/messages", {"x-api-key": KEY_A}, {
        "model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "tools": [{"name": "get_weather", "input_schema": WEATHER_PARAMS}], "tool_choice": {"type": "any"}})
    kinds = [TypeAdapter(RawMessageStreamEvent).validate_python(e).type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds


# a forced call with a long string argument: its text streams in many pieces (one per decode step at most)
NOTE_PARAMS = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60}},
               "required": ["text"], "additionalProperties": False}
NOTE_TOOL = {"name": "save_note", "description": "Save a note.", "parameters": NOTE_PARAMS}
MIN_ARGUMENT_DELTAS = 10  # 40+ characters of argument text, streamed as generated, arrive over at least this many steps


def unparsed(item) -> dict:
    """An output item's fields but its id and the fields the openai stream helper's parsing adds."""
    fields = item.model_dump(exclude={"id", "parsed_arguments"})
    for part in fields.get("content") or []:
        part.pop("parsed", None)
    return fields


def test_responses_stream_a_forced_call_as_it_is_generated(oai):
    """openai's `responses.stream` helper: the function_call item opens (call_id, name) before its arguments,
    which arrive as many deltas (each from its own decode step: the first came that many steps before the call
    ended), then `.done`; the items streamed are the final object's, ids included, and equal the whole answer's."""
    body = dict(model="m", input="Note this.", tools=[{"type": "function", **NOTE_TOOL}], max_output_tokens=300,
                tool_choice={"type": "function", "name": "save_note"}, temperature=0)
    with oai.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    whole = oai.responses.create(**body)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert len(deltas) >= MIN_ARGUMENT_DELTAS and added.item.arguments == "" and added.item.name == "save_note"
    assert kinds.index("response.output_item.added", kinds.index("response.function_call_arguments.delta") - 1) < \
        kinds.index("response.function_call_arguments.delta") < kinds.index("response.function_call_arguments.done")
    (call,) = [i for i in final.output if i.type == "function_call"]
    assert "".join(d.delta for d in deltas) == call.arguments and added.item.call_id == call.call_id
    done = [e.item.model_dump() for e in events if e.type == "response.output_item.done"]
    assert len(done) == len(final.output) and all(  # (the helper's final items add parsed fields)
        item == {k: v for k, v in parsed.model_dump().items() if k in item} for item, parsed in zip(done, final.output))
    assert [unparsed(i) for i in final.output] == [unparsed(i) for i in whole.output]
    jsonschema.validate(json.loads(call.arguments), NOTE_PARAMS)


def test_chat_stream_a_forced_call_as_it_is_generated(oai):
    """openai's `chat.completions.stream` helper: the call's first chunk has index, id and name, then many
    argument fragments; the completion it accumulates equals the whole answer."""
    body = dict(model="m", messages=[{"role": "user", "content": "Note this."}], max_tokens=300, temperature=0,
                tools=[{"type": "function", "function": {**NOTE_TOOL, "strict": True}}], tool_choice="required")
    with oai.chat.completions.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    whole = oai.chat.completions.create(**body)
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) >= MIN_ARGUMENT_DELTAS
    (call,) = whole.choices[0].message.tool_calls
    assert deltas[-1].arguments == call.function.arguments
    fields = {"role", "content", "reasoning_content", "tool_calls"}  # (the helper adds parsed fields and indexes)
    joined, want = final.choices[0].message.model_dump(), whole.choices[0].message.model_dump()
    assert [{k: joined[k] for k in fields - {"tool_calls"}}, [(c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
            for c in joined["tool_calls"]]] == [{k: want[k] for k in fields - {"tool_calls"}},
                                                [(call.id, call.type, call.function.name, call.function.arguments)]]
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


def test_anthropic_stream_a_forced_call_as_it_is_generated(claude):
    """anthropic's `messages.stream` helper: the tool_use block starts (id, name) before its input, which arrives
    as many input_json_delta fragments; the message it accumulates equals the whole answer."""
    body = dict(model="m", max_tokens=300, messages=[{"role": "user", "content": "Note this."}],
                tools=[{"name": NOTE_TOOL["name"], "input_schema": NOTE_PARAMS}], tool_choice={"type": "any"},
                extra_body=GREEDY)
    with claude.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    whole = claude.messages.create(**body)
    deltas = [e for e in events if e.type == "input_json"]
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    assert len(deltas) >= MIN_ARGUMENT_DELTAS and events.index(start) < events.index(deltas[0])
    assert start.content_block.name == "save_note" and start.content_block.input == {}
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})  # (usage: the cache)
    assert whole.stop_reason == "tool_use" and deltas[-1].snapshot == whole.content[-1].input


# --- what real clients found ----------------------------------------------------------------

# string lengths are bounded so that a random-weight model ends its strings (the grammar's job is what they hold)
NOTE_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24}, "mood": {"enum": ["good", "bad"]},
                                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                         "maxItems": 3},
                                                "score": {"type": ["integer", "null"], "maximum": 999}},
               "required": ["title", "mood", "tags", "score"], "additionalProperties": False}


@pytest.mark.parametrize("effort", ["none", "low"])
def test_json_schema_with_strings_parses_for_every_seed(oai, effort):
    """Sampled (not greedy) json_schema output with free strings: every seed parses strictly and validates,
    and what parses is the content the client receives."""
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": NOTE_SCHEMA}}
    # max_tokens fits the 1024-token context: K3's response-format message (schema included) and thinking-effort
    # message make the prompt ~810 synthetic (mostly one-byte) tokens
    for seed in range(6):
        r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "A note, as JSON."}], seed=seed,
                                        temperature=1.0, max_tokens=200, reasoning_effort=effort, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), NOTE_SCHEMA)


def test_bad_schemas_and_tools_are_400_and_valid_ones_work(oai):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    bad = [{"type": "objekt"}, {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nowhere"}}},
           {"type": "string", "pattern": "(("}, {"$ref": "http://169.254.169.254/schema.json"}, {"not": {}}]
    for schema in bad:
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(**chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        with pytest.raises(openai.BadRequestError):
            oai.responses.create(model="m", input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
        tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}}]
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(**chat, tools=tool, tool_choice="required")
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="m", input="hi", text={"format": {"type": "xml"}})
    with pytest.raises(openai.BadRequestError, match="parameters"):  # not a JSON schema, even with tool_choice auto
        oai.chat.completions.create(**chat, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}])
    nullable = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": ["string", "null"], "maxLength": 5}}, "required": ["text"]}}}]
    r = oai.chat.completions.create(**chat, tools=nullable, tool_choice="required", reasoning_effort="none", temperature=1, seed=3)
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), nullable[0]["function"]["parameters"])


def test_pydantic_function_tools_with_optional_and_nested_models(oai):
    """openai.pydantic_function_tool schemas (Optional -> anyOf with null, a nested model -> $ref into $defs)
    for a forced K3 call: accepted, and the arguments validate against the model (small models: the tool
    declaration alone is ~770 tokens)."""
    from pydantic import BaseModel, Field

    class P(BaseModel):
        c: str = Field(max_length=3)
        d: int | None = Field(le=9)

    class T(BaseModel):
        w: int | None = Field(le=9)
        p: P

    tool = openai.pydantic_function_tool(T)
    assert "$ref" in json.dumps(tool) and "anyOf" in json.dumps(tool)
    for seed in range(3):
        r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Plan."}], tools=[tool],
                                        tool_choice={"type": "function", "function": {"name": "T"}}, seed=seed,
                                        temperature=1, max_tokens=250, reasoning_effort="none")
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        T.model_validate_json(call.function.arguments)


def test_completions_lists_of_prompts_token_ids_and_n(oai):
    single = [oai.completions.create(model="m", prompt=p, max_tokens=5, **GREEDY).choices[0].text for p in ("Once", "Twice")]
    both = oai.completions.create(model="m", prompt=["Once", "Twice"], max_tokens=5, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == single
    assert both.usage.completion_tokens == 10
    ids = oai.completions.create(model="m", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, **GREEDY)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    streamed = {0: "", 1: ""}
    for chunk in oai.completions.create(model="m", prompt=["Once", "Twice"], max_tokens=5, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == single
    n = oai.completions.create(model="m", prompt="Once", max_tokens=8, n=3, temperature=1, seed=11)
    assert [c.index for c in n.choices] == [0, 1, 2] and len({c.text for c in n.choices}) > 1
    chats = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
                                        reasoning_effort="none", temperature=1, extra_body={"ignore_eos": True})
    assert [c.index for c in chats.choices] == [0, 1] and chats.usage.completion_tokens == 12
    streamed_n = {0: "", 1: ""}
    for chunk in oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
                                             reasoning_effort="none", stream=True, **GREEDY):
        for c in chunk.choices:
            streamed_n[c.index] += c.delta.content or ""
    assert streamed_n[0] == streamed_n[1]


def test_completions_text_has_no_special_token_names(server, oai):
    """A random-weight engine samples reserved special tokens: a completion's text is the output decoded
    without them (vLLM's skip_special_tokens), whole and streamed."""
    from moe_export.runtime.sampling import SamplingParams

    tok = server.llm.tokenizer
    ids = tokenize(server, prompt="Once upon a time")
    with_specials = 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, ignore_eos=True)
        out = asyncio.run(server.llm.generate(ids, params))
        with_specials += any(tok.is_special(t) for t in out.output_ids)
        body = {"model": "m", "prompt": ids, "max_tokens": 64, "temperature": 1, "seed": seed, "extra_body": {"ignore_eos": True}}
        whole = oai.completions.create(**body).choices[0].text
        runs, run = [], []  # the output's text between special tokens (a special token is a text boundary)
        for t in out.output_ids:
            if tok.is_special(t):
                runs.append(run)
                run = []
            else:
                run.append(t)
        assert whole == "".join(tok.decode(r) for r in [*runs, run])
        assert "".join(c.choices[0].text for c in oai.completions.create(**body, stream=True) if c.choices) == whole
    assert with_specials  # the check above could fail


def test_unseeded_requests_differ_and_seeded_ones_repeat(oai, claude):
    body = {"model": "m", "messages": [{"role": "user", "content": "Surprise me."}], "max_tokens": 24,
            "reasoning_effort": "none", "temperature": 1}
    unseeded = {oai.chat.completions.create(**body).choices[0].message.content for _ in range(3)}
    assert len(unseeded) > 1
    seeded = {oai.chat.completions.create(**body, seed=7).choices[0].message.content for _ in range(2)}
    assert len(seeded) == 1
    responses = {oai.responses.create(model="m", input="Surprise me.", max_output_tokens=24, temperature=1, store=False,
                                      reasoning={"effort": "none"}).output_text for _ in range(3)}
    assert len(responses) > 1
    # (a sampled answer may be empty: Anthropic's content is then [], so the text blocks are joined)
    messages = {"".join(block.text for block in claude.messages.create(
        model="m", max_tokens=24, messages=[{"role": "user", "content": "Surprise me."}], thinking={"type": "disabled"},
        extra_body={"temperature": 1}).content if block.type == "text") for _ in range(3)}
    assert len(messages) > 1


@pytest.mark.parametrize("effort, tier", [("minimal", "low"), ("medium", "high")])
def test_openai_effort_names_map_onto_the_tiers(oai, effort, tier):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Think."}], reasoning_effort=effort,
                                    max_tokens=40, **GREEDY)
    assert r.usage.completion_tokens_details.reasoning_tokens == SERVE_THINKING[tier]
    resp = oai.responses.create(model="m", input="Think.", reasoning={"effort": effort}, max_output_tokens=40, **GREEDY)
    assert resp.usage.output_tokens_details.reasoning_tokens == SERVE_THINKING[tier]


def running_sequences(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("moe_export_running_sequences ")))


def test_non_streaming_client_that_disconnects_aborts_its_sequence(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 1900,
            "reasoning_effort": "none", "ignore_eos": True, **GREEDY}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=0.3)
    while running_sequences(server) and time.monotonic() - start < 1.2:
        time.sleep(0.02)
    # gone within 1.2 s of the request, before 1,900 tokens could finish (the tiny model makes well under 1,500
    # tokens/s on these CPUs): it was aborted
    assert running_sequences(server) == 0 and time.monotonic() - start < 1.2


def test_responses_deleted_ancestor_is_named_and_input_items_listed(oai):
    opts = {"max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "none"}}
    r1 = oai.responses.create(model="m", input="One.", **opts)
    r2 = oai.responses.create(model="m", input=[{"role": "user", "content": "Two."}], previous_response_id=r1.id, **opts)
    items = oai.responses.input_items.list(r2.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Two."
    assert [i.content[0].text for i in oai.responses.input_items.list(r1.id, order="asc").data] == ["One."]
    oai.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError) as gone:
        oai.responses.create(model="m", input="Three.", previous_response_id=r2.id, **opts)
    assert r1.id in str(gone.value) and "ancestor" in str(gone.value)


def test_anthropic_input_tokens_count_tokens_and_budget_check(claude):
    messages = [{"role": "user", "content": "Count me."}]
    counted = claude.messages.count_tokens(model="m", messages=messages, system="be brief", thinking={"type": "disabled"})
    whole = claude.messages.create(model="m", max_tokens=4, messages=messages, system="be brief",
                                   thinking={"type": "disabled"}, extra_body=GREEDY)
    usage = whole.usage  # Anthropic's definition: the prompt is input + cache creation + cache read
    assert counted.input_tokens == usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert usage.input_tokens > 0
    with claude.messages.stream(model="m", max_tokens=4, messages=messages, system="be brief",
                                thinking={"type": "disabled"}, extra_body=GREEDY) as stream:
        start = next(e for e in stream if e.type == "message_start")
        assert start.message.usage.input_tokens <= counted.input_tokens
        streamed = stream.get_final_message().usage
    assert counted.input_tokens == streamed.input_tokens + streamed.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model="m", max_tokens=8, messages=messages, thinking={"type": "enabled", "budget_tokens": 8})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=8, messages=messages)


def test_prompt_plus_max_tokens_beyond_the_context_is_400(server, oai):
    prompt = "Once upon a time " * 60
    n = len(tokenize(server, prompt=prompt))
    context = SERVE_LIMITS["max_seq_len"]
    assert n < context
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {context}"):
        oai.completions.create(model="m", prompt=prompt, max_tokens=context - n + 1)
    exact = oai.completions.create(model="m", prompt=prompt, max_tokens=context - n, extra_body={"ignore_eos": True}, **GREEDY)
    assert exact.usage.total_tokens == context
    messages = [{"role": "user", "content": prompt}]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.chat.completions.create(model="m", messages=messages, max_tokens=context - n + 1)
    r = oai.chat.completions.create(model="m", messages=messages, reasoning_effort="none", **GREEDY)  # default: what fits
    assert r.usage.total_tokens <= context


def test_sampling_controls_reach_the_sampler(server, oai):
    """logit_bias, penalties, min_tokens and top_logprobs through the openai client: each changes what comes
    back (none is ignored), and bad values are 400s."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "reasoning_effort": "none",
            **GREEDY}
    tok = server.llm.tokenizer
    target = tok.encode("zebra")[0]
    biased = oai.completions.create(model="m", prompt="Once", max_tokens=5, logit_bias={str(target): 100}, **GREEDY)
    assert biased.choices[0].text == tok.decode([target]) * 5
    plain = oai.completions.create(model="m", prompt="Once", max_tokens=12, **GREEDY).choices[0].text
    penalised = oai.completions.create(model="m", prompt="Once", max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0,
                                       extra_body={"repetition_penalty": 1.5}, **GREEDY).choices[0].text
    assert penalised != plain
    r = oai.chat.completions.create(**chat, logprobs=True, top_logprobs=3)
    for entry in r.choices[0].logprobs.content:
        alts = entry.top_logprobs
        assert len(alts) == 3 and alts[0].logprob >= alts[1].logprob >= alts[2].logprob
        # greedy: the chosen token is the most likely one; exact, both read from one log-softmax row
        assert alts[0].logprob == entry.logprob
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(**chat, logprobs=True, top_logprobs=50)  # OpenAI's maximum is 20
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.chat.completions.create(**chat, logit_bias={"99999999": 5})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(**chat, presence_penalty=3)
    cmpl = oai.completions.create(model="m", prompt="Once", max_tokens=5, logprobs=2, **GREEDY).choices[0]
    lp = cmpl.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # alternatives keyed by text (two byte tokens may both read as U+FFFD); greedy: none is more likely
    assert all(1 <= len(alts) <= 2 and chosen >= max(alts.values()) - 1e-4
               for alts, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def metric(server, name: str) -> float:
    line = next(x for x in httpx.get(f"{server.url}/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_prefix_cache_across_requests(server, oai, claude, serve_engine):
    """Requests sharing a long system prompt: the second and later ones report cached prompt tokens (OpenAI
    `prompt_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens`), a whole number of cache blocks
    within the shared prefix, and the hit-rate counters grow; their answers are a cache-less server's
    (`--no-prefix-caching`, which reports no cached tokens) for the same requests."""
    system = "Prefix cache probe 7f3a. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(12))
    questions = ["What is 2 + 2?", "Name a river.", "Which colour is the sky?"]

    def messages(q):
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    def ask(client, q):
        return client.chat.completions.create(model="m", messages=messages(q), max_tokens=6, reasoning_effort="none", **GREEDY)

    p0, p1 = (tokenize(server, model="m", messages=messages(q), reasoning_effort="none") for q in questions[:2])
    shared = next(i for i, (a, b) in enumerate(zip(p0, p1)) if a != b)

    queried, hits = metric(server, "moe_export_prefix_cache_queried_tokens_total"), metric(server, "moe_export_prefix_cache_hit_tokens_total")
    first, second = ask(oai, questions[0]), ask(oai, questions[1])
    # the first may share the chat template's opening block with earlier requests, no more
    block = server.llm.llm.engine.block_size
    assert first.usage.prompt_tokens_details.cached_tokens <= block
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert block < cached <= shared and cached % block == 0
    msg = claude.messages.create(model="m", system=system, messages=[{"role": "user", "content": questions[2]}],
                                 max_tokens=6, thinking={"type": "disabled"}, extra_body=GREEDY)
    # Anthropic's input_tokens leave out the cache reads, whole and streamed (message_delta)
    prompt = claude.messages.count_tokens(model="m", system=system, messages=[{"role": "user", "content": questions[2]}],
                                          thinking={"type": "disabled"}).input_tokens
    assert 0 < msg.usage.cache_read_input_tokens and msg.usage.cache_read_input_tokens % block == 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    with claude.messages.stream(model="m", system=system, messages=[{"role": "user", "content": questions[2]}],
                                max_tokens=6, thinking={"type": "disabled"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens > 0 and streamed.input_tokens + streamed.cache_read_input_tokens == prompt
    assert metric(server, "moe_export_prefix_cache_queried_tokens_total") - queried >= first.usage.prompt_tokens + second.usage.prompt_tokens
    assert metric(server, "moe_export_prefix_cache_hit_tokens_total") - hits >= cached + msg.usage.cache_read_input_tokens
    proc, url = start_cli_server([str(serve_engine), "--default-effort", "low", "--served-model-name", "m", "--no-prefix-caching"])
    try:
        plain = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        want = [ask(plain, q) for q in questions[:2]]
    finally:
        stop_process(proc)
    assert [w.usage.prompt_tokens_details.cached_tokens for w in want] == [0, 0]
    assert [w.choices[0].message.content for w in want] == [first.choices[0].message.content, second.choices[0].message.content]


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 1.0, "seed": 11}])
def test_streamed_logprobs_equal_the_whole_answers(oai, sampling):
    """stream=True through the openai client: chat chunks carry logprobs.content (token, logprob, bytes,
    top_logprobs) and completions chunks tokens / token_logprobs / top_logprobs / text_offset; joined, they are
    the non-streamed request's (same greedy or seeded request)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
            "reasoning_effort": "none", "logprobs": True, "top_logprobs": 2, **sampling}
    whole = oai.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [e for c in oai.chat.completions.create(**chat, stream=True) for ch in c.choices if ch.logprobs
                for e in ch.logprobs.content]
    assert len(whole) == len(streamed) == 10
    for w, s in zip(whole, streamed):
        assert (s.token, s.bytes) == (w.token, w.bytes) and s.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [a.token for a in s.top_logprobs] == [a.token for a in w.top_logprobs]
        assert [a.logprob for a in s.top_logprobs] == pytest.approx([a.logprob for a in w.top_logprobs], abs=1e-4)
    cmpl = {"model": "m", "prompt": "Once upon", "max_tokens": 8, "logprobs": 2, **sampling}
    want = oai.completions.create(**cmpl).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(**cmpl, stream=True) if c.choices and c.choices[0].logprobs]
    got = {k: [v for ch in chunks for v in getattr(ch.logprobs, k)] for k in ("tokens", "token_logprobs", "text_offset")}
    assert got["tokens"] == want.logprobs.tokens and got["text_offset"] == want.logprobs.text_offset
    assert got["token_logprobs"] == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    tops = [alts for ch in chunks for alts in ch.logprobs.top_logprobs]
    assert [sorted(a) for a in tops] == [sorted(a) for a in want.logprobs.top_logprobs]
    assert "".join(ch.text for ch in chunks) == want.text


def test_responses_chain_is_exact_across_a_restart(serve_engine, tmp_path):
    """A stored turn is continued as the tokens the model produced, even when it sampled special tokens that
    carry no text (a random-weight model's reserved ids): the same prompt before and after a restart, and
    before it the kept state is reused."""
    from moe_export.runtime.tokenizer import load_tokenizer

    store = str(tmp_path / "h.sqlite")
    opts = {"max_output_tokens": 40, "temperature": 0, "reasoning": {"effort": "low"}}
    first = InProcessServer(serve_engine, store_path=store, served_model_names=("m",), default_effort="low")
    try:
        oai = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
        r1 = oai.responses.create(model="m", input="Plan my week.", **opts)
        before = oai.responses.create(model="m", input="More.", previous_response_id=r1.id, store=False, **opts)
    finally:
        first.stop()
    turn = json.loads(sqlite3.connect(store).execute("SELECT output_message FROM responses").fetchone()[0])["turn_ids"]
    tok = load_tokenizer(serve_engine)
    assert any(tok.decode([t]).startswith("<|reserved") for t in turn)  # the case the check must cover
    assert before.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    second = InProcessServer(serve_engine, store_path=store, served_model_names=("m",), default_effort="low")
    try:
        oai = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
        after = oai.responses.create(model="m", input="More.", previous_response_id=r1.id, store=False, **opts)
    finally:
        second.stop()
    assert after.usage.input_tokens == before.usage.input_tokens
    assert [i.model_dump(exclude={"id"}) for i in after.output] == [i.model_dump(exclude={"id"}) for i in before.output]

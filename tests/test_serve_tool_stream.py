"""What a streaming client sees of a tool call that opened in the stream and then did not parse (possible only when
no grammar enforces the call: tool_choice auto), on the three APIs, through the official clients' stream helpers
over a fake AsyncLLM whose output is the parser's for such a turn (`OutputParser`: the call's pieces, its end
"failed", its text as content; then a call that parses). The final object decides: it holds the text as content
and only the call that parsed, as the whole answer does."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
from fake_llm import VOCAB, FakeLLM
from moe_export.runtime.chat import ToolCallDelta
from moe_export.runtime.client.request_core import ChatOutput, StreamDelta
from moe_export.runtime.entrypoints.server.app import create_app
from moe_export.runtime.entrypoints.server.service import EngineInfo, ServerSettings

FAILED_TEXT = '<|open|>call tool="f"<|sep|>...'  # (what the content holds of the failed call: its text as written)
GOOD = {"id": "functions.f:1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
TOOLS = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


class FailedCallLLM(FakeLLM):
    """Each answer: call functions.f:0 opens, streams '{"a": 7', fails (its text follows as content); then
    functions.f:1 streams whole."""

    async def _stream(self, rid, prompt_tokens, tier, logprobs=False, first_call=0):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "reasoning_tokens": 0, "cached_tokens": 0}
        out = ChatOutput(rid, [1] * prompt_tokens, [5, 6, 7], "fgh", None, FAILED_TEXT, [GOOD], "tool_calls", usage,
                         None, tool_call_parse_failures=1)
        yield StreamDelta(rid, [5], parts=[("tool_call", ToolCallDelta(0, "functions.f:0", "f", '{"a": '))],
                          thinking_tier=tier)
        yield StreamDelta(rid, [6], content=FAILED_TEXT, parts=[("tool_call", ToolCallDelta(0, arguments="7", end="failed")),
                                                                ("content", FAILED_TEXT)], thinking_tier=tier)
        yield StreamDelta(rid, [7], parts=[("tool_call", ToolCallDelta(1, GOOD["id"], "f", '{"a": 1}', "done"))],
                          finished=True, output=out, thinking_tier=tier)


def app():
    return create_app(FailedCallLLM(), ServerSettings(engine_dir=".", model_name="m"),
                      EngineInfo(max_seq_len=4096, max_batch=4, vocab_size=VOCAB))


def http(application) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://t")


def test_responses_close_a_failed_call_incomplete_and_complete_without_it():
    async def run():
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http(app()))
        body = dict(model="m", input="hi", tools=[TOOLS])
        async with client.responses.stream(**body) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        return events, final, await client.responses.create(**body)

    events, final, whole = asyncio.run(run())
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("function_call", "incomplete"), ("message", "completed"),
                                                  ("function_call", "completed")]
    assert (done[0].call_id, done[0].arguments) == ("functions.f:0", '{"a": 7')
    assert [e.item_id for e in events if e.type == "response.function_call_arguments.done"] == [done[2].id]
    assert [(i.type, i.id) for i in final.output] == [("message", done[1].id), ("function_call", done[2].id)]
    assert [i.type for i in whole.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == whole.output[0].content[0].text == FAILED_TEXT
    assert final.output[1].call_id == whole.output[1].call_id == "functions.f:1"


def test_chat_chunks_keep_a_failed_call_that_the_whole_answer_does_not_have():
    """The chunks joined by index hold the failed call with the arguments it streamed (not JSON: openai's
    `chat.completions.stream` helper, which reads strict tools' arguments as JSON, raises on them)."""
    async def run():
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http(app()))
        body = dict(model="m", messages=[{"role": "user", "content": "hi"}],
                    tools=[{"type": "function", "function": {"name": "f", "parameters": TOOLS["parameters"]}}])
        chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
        return chunks, await client.chat.completions.create(**body)

    chunks, whole = asyncio.run(run())
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, list] = {}
    for call in (tc for d in deltas for tc in d.tool_calls or []):
        calls.setdefault(call.index, [call.id, ""])[1] += call.function.arguments or ""
    want = whole.choices[0].message
    assert "".join(d.content or "" for d in deltas) == want.content == FAILED_TEXT
    assert [(c.id, c.function.arguments) for c in want.tool_calls] == [("functions.f:1", '{"a": 1}')]
    assert calls == {0: ["functions.f:0", '{"a": 7'], 1: ["functions.f:1", '{"a": 1}']}


def test_anthropic_stops_a_failed_call_block_and_the_message_has_only_the_call_that_parsed():
    """The failed call's tool_use block stops like any other; the whole message has its text and the call that
    parsed."""
    async def run():
        import httpx2  # (the anthropic client's fork of httpx)

        client = anthropic.AsyncAnthropic(base_url="http://t", api_key="k", http_client=httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app()), base_url="http://t"))
        body = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                    tools=[{"name": "f", "input_schema": TOOLS["parameters"]}])
        async with client.messages.stream(**body) as stream:
            events = [e async for e in stream]
            joined = await stream.get_final_message()
        return events, joined, await client.messages.create(**body)

    events, joined, whole = asyncio.run(run())
    kinds = [(e.type, getattr(e, "index", None)) for e in events if e.type.startswith("content_block")]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
                     ("content_block_stop", 2)]
    assert [(b.type, getattr(b, "id", None)) for b in whole.content] == [("text", None), ("tool_use", "functions.f:1")]
    assert whole.content[0].text == FAILED_TEXT and whole.stop_reason == "tool_use"
    # the helper's message joins every block streamed: the failed call's too (its input read from the partial JSON)
    assert [(b.type, getattr(b, "input", None)) for b in joined.content] == [("tool_use", {"a": 7}), ("text", None),
                                                                              ("tool_use", {"a": 1})]

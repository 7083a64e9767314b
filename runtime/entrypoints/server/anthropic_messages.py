"""Anthropic Messages (`POST /v1/messages`, whole or streamed) and `POST /v1/messages/count_tokens`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.edge import answer, authorize, documented, parse, service_of
from moe_export.runtime.entrypoints.server.errors import APIError
from moe_export.runtime.entrypoints.server.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from moe_export.runtime.entrypoints.server.service import ChatRun, Disconnected, Service

ROUTE = "/v1/messages"
router = APIRouter()


def anthropic_chat(req) -> tuple[list[dict], list | None, object, object]:
    """(messages, tools, tool_choice, effort) of a Messages or count_tokens body. No `thinking` field: no
    reasoning (Anthropic's default)."""
    messages = convert.messages_from_anthropic(req.system, req.messages)
    tools = convert.anthropic_tools(req.tools)
    return messages, tools, convert.anthropic_tool_choice(req.tool_choice, tools), convert.anthropic_effort(req.thinking)


@router.post(ROUTE + "/count_tokens", openapi_extra=documented(AnthropicCountTokensRequest))
async def count_tokens_route(request: Request):
    authorize(request)
    req = await parse(request, AnthropicCountTokensRequest)
    svc = service_of(request)
    svc.check_model(req.model)
    svc.check_limits(req.messages, req.tools, None)
    messages, tools, tool_choice, effort = anthropic_chat(req)
    count = len((await svc.render(messages, tools=tools, tool_choice=tool_choice, response_format=None,
                                  effort=effort)).prompt_ids)
    svc.metrics.requests.labels(ROUTE + "/count_tokens", "200").inc()
    return {"input_tokens": count}


@router.post(ROUTE, openapi_extra=documented(AnthropicMessagesRequest))
async def messages_route(request: Request):
    authorize(request)
    req = await parse(request, AnthropicMessagesRequest)
    return answer(await create_message(service_of(request), req, request.is_disconnected), request.url.path)


async def create_message(svc: Service, req: AnthropicMessagesRequest, disconnected: Disconnected = None
                         ) -> dict | AsyncIterator[dict]:
    """The message object, or (stream) its events."""
    model = svc.check_model(req.model)
    svc.check_limits(req.messages, req.tools, req.max_tokens)
    messages, tools, tool_choice, effort = anthropic_chat(req)
    if isinstance(effort, int) and effort >= req.max_tokens:
        raise APIError(400, f"max_tokens must be greater than thinking.budget_tokens ({req.max_tokens} <= {effort})",
                       "max_tokens")
    messages = await svc.inline_image_urls(messages)
    parallel = not (req.tool_choice or {}).get("disable_parallel_tool_use", False)
    sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=None, stop=req.stop_sequences,
                    session={"user": req.metadata.user_id if req.metadata is not None else None})
    message_id = convert.new_id("msg_")
    rendered = await svc.render(messages, tools=tools, tool_choice=tool_choice, response_format=None, effort=effort)
    run = await svc.run_chat(message_id, rendered, sampling, max_tokens=req.max_tokens, parallel=parallel)
    if req.stream:
        return message_events(svc, run, message_id, model)
    out = await svc.final_output(run.deltas, disconnected)
    svc.finish(ROUTE, out, run.tier)
    return convert.anthropic_message(out, message_id=message_id, model=model)


def event(kind: str, **fields) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


def close_block(kind: str | None, index: int) -> list[dict]:
    """Events ending the open content block (a thinking block gets its empty signature first)."""
    events = []
    if kind == "thinking":
        events.append(event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""}))
    if kind is not None:
        events.append(event("content_block_stop", index=index))
    return events


async def message_events(svc: Service, run: ChatRun, message_id: str, model: str) -> AsyncIterator[dict]:
    """message_start, the thinking / text / tool_use blocks as generated, message_delta (stop reason, usage),
    message_stop. A tool_use block starts once the call's name is read (`input` {}), gets its arguments as
    `input_json_delta` fragments, and stops when the call ends. A call the model opened that then does not parse
    (not enforced by a grammar, so only under tool_choice auto) stops like the others and is not in the message:
    there its text is content, as in the whole answer (a text block after it streams that text)."""
    yield event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}})
    index, open_kind, out = -1, None, None
    async for d in run.deltas:
        for part, value in d.parts:
            kind = {"reasoning": "thinking", "content": "text"}.get(part, "tool_use")
            if open_kind != kind or kind == "tool_use" and value.id is not None:
                for e in close_block(open_kind, index):
                    yield e
                index += 1
                open_kind = kind
                block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else
                         {"type": "text", "text": ""} if kind == "text" else
                         {"type": "tool_use", "id": value.id, "name": value.name, "input": {}})
                yield event("content_block_start", index=index, content_block=block)
            if kind == "tool_use":
                if value.arguments:
                    yield event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": value.arguments})
                if value.end is not None:
                    for e in close_block(open_kind, index):
                        yield e
                    open_kind = None
                continue
            delta = {"type": "thinking_delta", "thinking": value} if kind == "thinking" else {"type": "text_delta", "text": value}
            yield event("content_block_delta", index=index, delta=delta)
        if d.finished:
            out = d.output
    for e in close_block(open_kind, index):
        yield e
    svc.finish(ROUTE, out, run.tier)
    yield event("message_delta", delta=convert.anthropic_stop(out), usage=convert.anthropic_usage(out.usage))
    yield event("message_stop")

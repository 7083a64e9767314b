"""OpenAI Responses (`/v1/responses`): create (whole or streamed events), chains through
previous_response_id over the store, retrieve, list input items, delete."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.edge import answer, authorize, documented, parse, service_of
from moe_export.runtime.entrypoints.server.errors import APIError, shown
from moe_export.runtime.entrypoints.server.protocol import ResponsesRequest
from moe_export.runtime.entrypoints.server.service import ChatRun, Disconnected, Service
from moe_export.runtime.entrypoints.server.store import MissingResponse, StoredResponse

ROUTE = "/v1/responses"
router = APIRouter()


@router.post(ROUTE, openapi_extra=documented(ResponsesRequest))
async def create_response_route(request: Request):
    scope = authorize(request)
    req = await parse(request, ResponsesRequest)
    return answer(await create_response(service_of(request), req, scope, request.is_disconnected), request.url.path)


def history_of(svc: Service, req: ResponsesRequest, scope: str) -> list[dict]:
    """The conversation before this turn (404 naming a missing or broken chain)."""
    if not req.previous_response_id:
        return []
    try:
        return svc.store.history(req.previous_response_id, scope)
    except MissingResponse as gone:
        what = (f"previous_response_id {gone.response_id!r} not found" if gone.response_id == req.previous_response_id
                else f"previous_response_id {req.previous_response_id!r}: its ancestor {gone.response_id!r} "
                     "was deleted, so the conversation cannot be rebuilt")
        raise APIError(404, what, "previous_response_id") from None


async def create_response(svc: Service, req: ResponsesRequest, scope: str, disconnected: Disconnected = None
                          ) -> dict | AsyncIterator[dict]:
    """The response object (stored when `store`), or (stream) its events."""
    model = svc.check_model(req.model)
    tools = convert.responses_tools(req.tools)
    svc.check_limits(req.input if isinstance(req.input, list) else None, tools, req.max_output_tokens, "input")
    history = history_of(svc, req, scope)
    input_messages, origins = convert.responses_messages_with_origins(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + input_messages
    names = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + origins
    svc.check_limits(messages, None, None, "input")
    tool_choice = convert.responses_tool_choice(req.tool_choice, tools)
    effort = convert.openai_effort((req.reasoning or {}).get("effort"))
    sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=None, seed=None, stop=None,
                    ignore_eos=req.ignore_eos, session={"prompt_cache_key": req.prompt_cache_key, "user": req.user})
    response_id = convert.new_id("resp_")
    renames = {"response_format.json_schema": "text.format", "response_format": "text.format", "max_tokens": "max_output_tokens"}
    with convert.user_field_names(names, renames):
        messages = await svc.inline_image_urls(messages)
        rendered = await svc.render(messages, tools=tools, tool_choice=tool_choice,
                                    response_format=convert.response_format_from_text(req.text), effort=effort)
        run = await svc.run_chat(response_id, rendered, sampling, max_tokens=req.max_output_tokens,
                                 parallel=req.parallel_tool_calls, max_tokens_param="max_output_tokens")
    turn = ResponseTurn(svc, req, scope, response_id, model, input_messages,
                        (req.reasoning or {}).get("effort") if isinstance(effort, str) else run.tier, run)
    if req.stream:
        return turn.events()
    return turn.complete(await svc.final_output(run.deltas, disconnected))


class ResponseTurn:
    """One started Responses turn: completes (stores) its response object, or streams its events."""

    def __init__(self, svc: Service, req: ResponsesRequest, scope: str, response_id: str, model: str,
                 input_messages: list[dict], effort_name, run: ChatRun) -> None:
        self.svc, self.req, self.scope, self.response_id, self.model = svc, req, scope, response_id, model
        self.input_messages, self.effort_name, self.run = input_messages, effort_name, run
        self.seq = 0
        self.open_item: dict | None = None
        self.output_index = -1

    def complete(self, out) -> dict:
        req = self.req
        status = "incomplete" if out.finish_reason == "length" else "completed"
        obj = convert.responses_object(self.response_id, req, model=self.model, status=status,
                                       output=convert.responses_output_items(out), usage=out.usage, effort=self.effort_name)
        if req.store:
            items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
            self.svc.store.put(StoredResponse(self.response_id, req.previous_response_id, items, self.input_messages,
                                              out.message(), obj), self.scope)
        self.svc.finish(ROUTE, out, self.run.tier)
        return obj

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})}

    def close_item(self) -> list[dict]:
        item, text, where = self.open_item["item"], self.open_item["text"], dict(output_index=self.output_index)
        events = []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], **where, content_index=0, text=text))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events.append(self.event("response.output_text.done", item_id=item["id"], **where, content_index=0, text=text,
                                     logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], **where, content_index=0, part=part))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", **where, item=item))
        self.open_item = None
        return events

    def open_new_item(self, kind: str) -> list[dict]:
        events = self.close_item() if self.open_item is not None else []
        self.output_index += 1
        if kind == "reasoning":
            item = {"type": "reasoning", "id": convert.new_id("rs_"), "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"type": "message", "id": convert.new_id("msg_"), "role": "assistant", "content": [],
                    "status": "in_progress"}
        self.open_item = {"item": item, "text": ""}
        events.append(self.event("response.output_item.added", output_index=self.output_index, item=item))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.output_index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def text_events(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open_item is None or self.open_item["item"]["type"] != kind:
            events += self.open_new_item(kind)
        self.open_item["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self.open_item["item"]["id"], output_index=self.output_index,
                                 content_index=0, delta=text, **extra))
        return events

    def call_events(self, obj: dict) -> list[dict]:
        events = []
        for call in (i for i in obj["output"] if i["type"] == "function_call"):
            self.output_index += 1
            where = dict(item_id=call["id"], output_index=self.output_index)
            events.append(self.event("response.output_item.added", output_index=self.output_index,
                                     item={**call, "arguments": "", "status": "in_progress"}))
            events.append(self.event("response.function_call_arguments.delta", **where, delta=call["arguments"]))
            events.append(self.event("response.function_call_arguments.done", **where, arguments=call["arguments"],
                                     name=call["name"]))
            events.append(self.event("response.output_item.done", output_index=self.output_index, item=call))
        return events

    async def events(self) -> AsyncIterator[dict]:
        shell = convert.responses_object(self.response_id, self.req, model=self.model, status="in_progress", output=[],
                                         usage=None, effort=self.effort_name)
        yield self.event("response.created", response=shell)
        yield self.event("response.in_progress", response=shell)
        out = None
        async for d in self.run.deltas:
            for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
                if text:
                    for e in self.text_events(kind, text):
                        yield e
            if d.finished:
                out = d.output
        for e in self.close_item() if self.open_item is not None else []:
            yield e
        obj = self.complete(out)
        for e in self.call_events(obj):
            yield e
        yield self.event("response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj)


def stored(request: Request, response_id: str):
    """(service, the stored response of the caller's key) or a 404 naming the id."""
    svc, scope = service_of(request), authorize(request)
    rec = svc.store.get(response_id, scope)
    if rec is None:
        raise APIError(404, f"response {shown(response_id)!r} not found")
    return svc, rec


@router.get(ROUTE + "/{response_id}")
async def get_response(response_id: str, request: Request):
    svc, rec = stored(request, response_id)
    svc.metrics.requests.labels("/v1/responses/{id}", "200").inc()
    return rec.response


@router.get(ROUTE + "/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request):
    svc, rec = stored(request, response_id)
    items = convert.responses_input_items(rec.input_items, response_id)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be asc or desc, got {order!r}", "order")
    if order == "desc":
        items = items[::-1]
    svc.metrics.requests.labels("/v1/responses/{id}/input_items", "200").inc()
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


@router.delete(ROUTE + "/{response_id}")
async def delete_response(response_id: str, request: Request):
    svc, scope = service_of(request), authorize(request)
    if not svc.store.delete(response_id, scope):
        raise APIError(404, f"response {shown(response_id)!r} not found")
    svc.metrics.requests.labels("/v1/responses/{id}", "200").inc()
    return {"id": response_id, "object": "response.deleted", "deleted": True}

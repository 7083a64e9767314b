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
from moe_export.runtime.chat import ToolCallDelta

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
    """One started Responses turn: completes (stores) its response object, or streams its events.

    Streamed, as OpenAI does: each output item (reasoning, message, function_call) opens with
    `response.output_item.added`, gets its deltas as the model generates them and closes with its `.done` events
    and `response.output_item.done`; a function call opens once its name is read (the item with name, call_id and
    arguments ""), then `response.function_call_arguments.delta` per fragment, `.done`. The final
    `response.completed` (or `.incomplete`) object gives the items the ids they streamed under. A call the model
    opened that then does not parse (not enforced by a grammar, so only under tool_choice auto) is closed by
    `response.output_item.done` with status "incomplete" and the arguments it streamed, and is not in the final
    object: there its text is part of the message's content, as in the whole answer (a message item after it
    streams that text)."""

    def __init__(self, svc: Service, req: ResponsesRequest, scope: str, response_id: str, model: str,
                 input_messages: list[dict], effort_name, run: ChatRun) -> None:
        self.svc, self.req, self.scope, self.response_id, self.model = svc, req, scope, response_id, model
        self.input_messages, self.effort_name, self.run = input_messages, effort_name, run
        self.seq = 0
        self.open_item: dict | None = None  # {"item", "text"} (a function call's text: its arguments so far)
        self.output_index = -1
        self.streamed_ids: dict[tuple[str, str | None], str] = {}  # (type, call_id) -> the id an item streamed under

    def complete(self, out) -> dict:
        req = self.req
        status = "incomplete" if out.finish_reason == "length" else "completed"
        obj = convert.responses_object(self.response_id, req, model=self.model, status=status,
                                       output=self.as_streamed(convert.responses_output_items(out)), usage=out.usage,
                                       effort=self.effort_name)
        if req.store:
            items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
            self.svc.store.put(StoredResponse(self.response_id, req.previous_response_id, items, self.input_messages,
                                              out.message(), obj), self.scope)
        self.svc.finish(ROUTE, out, self.run.tier)
        return obj

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})}

    def as_streamed(self, items: list[dict]) -> list[dict]:
        """The final output items with the ids they streamed under (a function call found by its call_id; the
        first reasoning / message item streamed, for the final one of its type)."""
        for item in items:
            key = (item["type"], item.get("call_id"))
            if key in self.streamed_ids:
                item["id"] = self.streamed_ids[key]
        return items

    def close_item(self, status: str = "completed") -> list[dict]:
        item, text, where = self.open_item["item"], self.open_item["text"], dict(output_index=self.output_index)
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            if status == "completed":
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"], **where,
                                         arguments=text, name=item["name"]))
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], **where, content_index=0, text=text))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events.append(self.event("response.output_text.done", item_id=item["id"], **where, content_index=0, text=text,
                                     logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], **where, content_index=0, part=part))
        item["status"] = status
        events.append(self.event("response.output_item.done", **where, item=item))
        self.open_item = None
        return events

    def open_new_item(self, kind: str, call: ToolCallDelta | None = None) -> list[dict]:
        """Close the open item and open one of `kind` (reasoning, message, or function_call: the `call` opening)."""
        events = self.close_item() if self.open_item is not None else []
        self.output_index += 1
        if kind == "reasoning":
            item = {"type": "reasoning", "id": convert.new_id("rs_"), "summary": [], "content": [], "status": "in_progress"}
        elif kind == "message":
            item = {"type": "message", "id": convert.new_id("msg_"), "role": "assistant", "content": [],
                    "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": convert.new_id("fc_"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
        self.streamed_ids.setdefault((kind, item.get("call_id")), item["id"])
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

    def call_events(self, piece: ToolCallDelta) -> list[dict]:
        """Events of a tool-call piece: the function_call item opening, an arguments delta, its end."""
        events = self.open_new_item("function_call", piece) if piece.id is not None else []
        if piece.arguments:
            self.open_item["text"] += piece.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open_item["item"]["id"],
                                     output_index=self.output_index, delta=piece.arguments))
        if piece.end is not None:
            events += self.close_item("completed" if piece.end == "done" else "incomplete")
        return events

    async def events(self) -> AsyncIterator[dict]:
        shell = convert.responses_object(self.response_id, self.req, model=self.model, status="in_progress", output=[],
                                         usage=None, effort=self.effort_name)
        yield self.event("response.created", response=shell)
        yield self.event("response.in_progress", response=shell)
        out = None
        async for d in self.run.deltas:
            for kind, value in d.parts:
                events = (self.call_events(value) if kind == "tool_call" else
                          self.text_events("reasoning" if kind == "reasoning" else "message", value))
                for e in events:
                    yield e
            if d.finished:
                out = d.output
        for e in self.close_item() if self.open_item is not None else []:
            yield e
        obj = self.complete(out)
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

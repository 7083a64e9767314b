"""What every route does at the HTTP edge: find the app's Service, check the API key, read and validate the
JSON body against its request model, and send an answer whole (JSON) or streamed (server-sent events)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from moe_export.common.errors import EngineDead, InputError, InternalError
from moe_export.runtime.entrypoints.server.errors import APIError, error_body, validation_message
from moe_export.runtime.entrypoints.server.service import Service
from moe_export.runtime.entrypoints.server.store import key_scope
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

log = logging.getLogger("moe_export.serve")
MAX_JSON_DEPTH = 128  # arrays and objects inside one another in a request body (real requests nest < 20 deep)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def service_of(request: Request) -> Service:
    return request.app.state.service


def authorize(request: Request) -> str:
    """The caller's store scope; 401 unless a configured key is presented (constant-time compare)."""
    digests = request.app.state.key_digests
    if not digests:
        return key_scope(None)
    auth = request.headers.get("authorization", "")
    presented = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    digest = key_digest(presented)
    ok = False
    for d in digests:
        ok |= hmac.compare_digest(digest, d)
    if not presented or not ok:
        raise APIError(401, "missing or invalid API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)")
    return key_scope(presented)


def documented(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body as `model` (the routes read bodies themselves, `parse`, so that a
    bad field is a 400 in the API's own error shape; the document at /openapi.json still describes them)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def validate(body: object, model: type[BaseModel]):
    """A decoded JSON body as `model`; 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, where = validation_message(exc)
        raise APIError(400, message, where) from None


def json_depth(value) -> int:
    """How deep arrays and objects nest in a decoded JSON value (a scalar: 0, `[[1]]`: 2), level by level."""
    depth, level = 0, [value]
    while True:
        containers = [c for c in level if isinstance(c, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for c in containers for v in (c.values() if isinstance(c, dict) else c)]


def decode(raw: bytes, model: type[BaseModel]):
    """A request body's bytes as `model`; 400 for JSON that does not parse or nests over MAX_JSON_DEPTH."""
    too_deep = APIError(400, f"request body nests arrays / objects more than {MAX_JSON_DEPTH} deep")
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    return validate(body, model)


async def parse(request: Request, model: type[BaseModel]):
    """The request's body as `model`, decoded and validated off the event loop (bodies run to megabytes)."""
    raw = await request.body()
    return await service_of(request).off_loop(decode, raw, model)


def sse(events: AsyncIterator[dict]) -> EventSourceResponse:
    return EventSourceResponse(events, ping=15, sep="\n")


async def ending_in_error_event(events: AsyncIterator[dict], path: str) -> AsyncIterator[dict]:
    """`events`, and when the request fails after its stream began, an error event in the route's shape
    (Anthropic's `event: error`, OpenAI's `data: {"error": ...}`) instead of a cut connection."""
    try:
        async for e in events:
            yield e
    except (InputError, InternalError) as exc:
        status = 400 if isinstance(exc, InputError) else 503 if isinstance(exc, EngineDead) else 500
        log.error("streamed request on %s failed: %s: %s", path, type(exc).__name__, exc)
        body = json.dumps(error_body(path, status, f"{type(exc).__name__}: {exc}"))
        yield {"event": "error", "data": body} if path.startswith("/v1/messages") else {"data": body}


def answer(result: dict | AsyncIterator[dict], path: str):
    """A service call's result as the HTTP answer to `path`: a dict as JSON, an event iterator as server-sent
    events."""
    return result if isinstance(result, dict) else sse(ending_in_error_event(result, path))

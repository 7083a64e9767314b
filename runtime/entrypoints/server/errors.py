"""Errors of the served APIs and their JSON shapes: OpenAI's on OpenAI routes, Anthropic's on /v1/messages; the
request-body size limit. An error never echoes more than a bounded part of what the client sent."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                      405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                      500: "server_error", 503: "server_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


MAX_SHOWN_CHARS = 64  # of a client's name (a model, a response id) in an error message
MAX_MESSAGE_CHARS = 2048  # of any error message (they quote request values)


def shown(value: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """A client-given name as an error message quotes it: cut to `limit` characters, saying how long it was."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


class ClientGone(Exception):
    """The client of a whole (non-streamed) answer disconnected; its request was aborted."""


class APIError(Exception):
    """An error answered with `status` and a message (OpenAI or Anthropic shape by route)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    """The JSON error body of a route (`path`): Anthropic's shape under /v1/messages, OpenAI's elsewhere."""
    message = shown(message, MAX_MESSAGE_CHARS)
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def validation_message(exc: ValidationError) -> tuple[str, str]:
    """(message, field) of a request body's first validation error."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", where


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes (declared Content-Length, or counted as read)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            body = error_body(scope["path"], 413, f"request body of {int(declared)} bytes is over the limit of {self.limit} bytes")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise APIError(413, f"request body is over the limit of {self.limit} bytes")
            return message

        return await self.app(scope, counted, send)

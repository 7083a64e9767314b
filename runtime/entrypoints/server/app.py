"""The HTTP application: OpenAI Chat Completions / Completions / Responses, Anthropic Messages, vLLM's
/tokenize and /detokenize, /v1/models, /health and /metrics, over one `AsyncLLM`; its OpenAPI document (request
bodies included) at /openapi.json.

The routes live in one module per API family and call the `Service` below HTTP (which `batch` calls directly).
Errors use OpenAI's shape on OpenAI routes and Anthropic's on /v1/messages; no handler ever returns a traceback.
When the engine core dies, /health answers 503 and `on_engine_dead` is called (the launcher stops the server and
exits non-zero, so that a supervisor restarts it; the Responses store is closed cleanly).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from moe_export.common.errors import EngineDead, InputError, InternalError
from moe_export.runtime.client.protocol import EngineClient
from moe_export.runtime.entrypoints.server import anthropic_messages, chat_completions, completions, responses, utility
from moe_export.runtime.entrypoints.server.edge import key_digest
from moe_export.runtime.entrypoints.server.errors import APIError, BodySizeLimit, ClientGone, error_body
from moe_export.runtime.entrypoints.server.service import EngineInfo, ServerSettings, Service
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

__all__ = ["EngineInfo", "ServerSettings", "create_app"]

log = logging.getLogger("moe_export.serve")
HEALTH_POLL_S = 0.5  # how often the app checks that the engine core still runs
DEAD_LINGER_S = 1.0  # /health answers 503 this long before the server stops (load balancers and clients see it)
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves on as requests finish, within seconds


def route_label(request: Request) -> str:
    """The metrics label of a request's route: its path template, path parameters spelled `{id}`."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return re.sub(r"\{[^}]*\}", "{id}", path) if path else "unmatched"


def add_error_handlers(app: FastAPI, svc: Service) -> None:
    def error_response(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
        svc.metrics.requests.labels(route_label(request), str(status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
        return JSONResponse(error_body(request.url.path, status, message, param), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        return error_response(request, 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail))

    @app.exception_handler(ClientGone)  # a whole answer's client went away
    @app.exception_handler(ClientDisconnect)  # the client went away while sending its body
    async def _client_gone(request: Request, exc: Exception):
        svc.metrics.requests.labels(route_label(request), "499").inc()
        return Response(status_code=499)

    @app.exception_handler(EngineDead)
    async def _engine_dead(request: Request, exc: EngineDead):
        log.error("the engine core is dead: %s", exc)
        return error_response(request, 503, f"the engine core stopped ({exc}); the server is restarting")

    def internal_error(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex
        log.error("internal error %s on %s", error_id, request.url.path, exc_info=exc)
        return error_response(request, 500, f"internal error ({type(exc).__name__}, error id {error_id}); see the server log")

    @app.exception_handler(InternalError)  # RequestFailed among them: that request fails, the server goes on
    async def _internal(request: Request, exc: InternalError):
        return internal_error(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return internal_error(request, exc)


async def watch_engine(svc: Service, on_engine_dead: Callable[[], None]) -> None:
    """Call `on_engine_dead` once, as soon as the engine core stops running."""
    while svc.healthy:
        await asyncio.sleep(HEALTH_POLL_S)
    log.error("the engine core is dead (%s); stopping the server", svc.llm.fatal_error)
    await asyncio.sleep(DEAD_LINGER_S)
    on_engine_dead()


def create_app(llm: EngineClient, settings: ServerSettings, info: EngineInfo | None = None,
               on_engine_dead: Callable[[], None] | None = None):
    """The ASGI app over a started AsyncLLM (`llm`). The app shuts the runtime down at exit."""
    svc = Service(llm, settings, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.ensure_future(watch_engine(svc, on_engine_dead)) if on_engine_dead is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with suppress(asyncio.CancelledError):
                    await watcher
            llm.shutdown()
            await svc.aclose()

    app = FastAPI(title="moe-export", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.service = svc
    app.state.key_digests = [key_digest(k) for k in settings.api_keys]
    add_error_handlers(app, svc)
    for family in (utility, chat_completions, completions, responses, anthropic_messages):
        app.include_router(family.router)
    return BodySizeLimit(app, settings.max_body_bytes)

"""The HTTP application: OpenAI Chat Completions / Completions / Responses, Anthropic Messages, vLLM's
/tokenize and /detokenize, /v1/models, /health and /metrics, over one `AsyncLLM`.

Every request's generation goes through the runtime's streaming API (so time to first token and
inter-token latency are measured the same way for streamed and whole responses). Errors use OpenAI's
shape on OpenAI routes and Anthropic's on /v1/messages; no handler ever returns a traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.metrics import ServerMetrics
from moe_export.runtime.entrypoints.server.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from moe_export.runtime.entrypoints.server.store import (
    MissingResponse,
    ResponseStore,
    StoredResponse,
    key_scope,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("moe_export.serve")

OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                      405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                      500: "server_error", 503: "server_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


MAX_CHOICES = 64  # most sequences one completions request may start (prompts x n)
DISCONNECT_POLL_S = 0.1  # how often a whole (non-streamed) answer checks that its client is still there


class ClientGone(Exception):
    """The client of a whole (non-streamed) answer disconnected; its request was aborted."""


class APIError(Exception):
    """An error answered with `status` and a message (OpenAI or Anthropic shape by route)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ServerSettings:
    """Serving limits and options. api_keys: accepted keys (empty: no auth). max_body_bytes: request body
    limit (413 above). max_queue: waiting requests before 429. default_max_tokens: generation length when a
    request gives none."""

    engine_dir: Path
    api_keys: tuple[str, ...] = ()
    store_path: str = ":memory:"
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_messages: int = 2048
    max_tools: int = 128
    default_max_tokens: int = 1024
    model_name: str = field(default="")
    served_model_names: tuple[str, ...] = ()
    accept_any_model: bool = False

    def __post_init__(self) -> None:
        """model_name: the name reported (the first served name); served_model_names: the names a request's
        `model` may give (404 for others, as vLLM; none given: the model name). accept_any_model: skip that
        check (in-process batch, whose input lines name models of other services)."""
        self.engine_dir = Path(self.engine_dir)
        self.served_model_names = tuple(self.served_model_names)
        if not self.model_name:
            self.model_name = self.served_model_names[0] if self.served_model_names else self.engine_dir.resolve().name
        if not self.served_model_names:
            self.served_model_names = (self.model_name,)


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs from the engine's config.json: context limit, sequence slots, logits width."""

    max_seq_len: int
    max_batch: int
    vocab_size: int

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> EngineInfo:
        cfg = EngineConfig.read(engine_dir)
        return cls(cfg.limits.max_seq_len, cfg.limits.max_batch, cfg.model.vocab_size)


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes (declared Content-Length, or counted as read)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            body = _error_body(scope["path"], 413, f"request body of {int(declared)} bytes is over the limit of {self.limit} bytes")
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


def _error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", where


def create_app(llm, settings: ServerSettings, info: EngineInfo | None = None) -> FastAPI:
    """The FastAPI app over a started AsyncLLM (`llm`). The app shuts the runtime down at exit."""
    info = info or EngineInfo.from_engine_dir(settings.engine_dir)
    from moe_export.runtime.sampling import SamplingParams, with_defaults

    tokenizer = llm.tokenizer
    store = ResponseStore(settings.store_path)
    metrics = ServerMetrics(llm.stats)
    key_digests = [_key_digest(k) for k in settings.api_keys]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        llm.shutdown()
        store.close()

    app = FastAPI(title="moe-export", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    # --- errors -------------------------------------------------------------------------------------
    def error_response(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
        metrics.requests.labels(_route_of(request), str(status)).inc()
        return JSONResponse(_error_body(request.url.path, status, message, param), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc.status, exc.message, exc.param)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        return error_response(request, 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request, exc.status_code, str(exc.detail))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        metrics.requests.labels(_route_of(request), "499").inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        error_id = uuid.uuid4().hex
        log.exception("internal error %s on %s", error_id, request.url.path)
        return error_response(request, 500, f"internal error ({type(exc).__name__}, error id {error_id}); see the server log")

    # --- helpers ------------------------------------------------------------------------------------
    def authorize(request: Request) -> str:
        """The caller's store scope; 401 unless a configured key is presented (constant-time compare)."""
        if not key_digests:
            return key_scope(None)
        auth = request.headers.get("authorization", "")
        presented = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        digest = _key_digest(presented)
        ok = False
        for d in key_digests:
            ok |= hmac.compare_digest(digest, d)
        if not presented or not ok:
            raise APIError(401, "missing or invalid API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)")
        return key_scope(presented)

    async def parse(request: Request, model: type[BaseModel]):
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            message, where = _validation_message(exc)
            raise APIError(400, message, where) from None

    def check_limits(messages: list | None, tools: list | None, max_tokens: int | None) -> None:
        if messages is not None and len(messages) > settings.max_messages:
            raise APIError(400, f"messages: {len(messages)} messages is over the limit of {settings.max_messages}", "messages")
        if tools is not None and len(tools) > settings.max_tools:
            raise APIError(400, f"tools: {len(tools)} tools is over the limit of {settings.max_tools}", "tools")
        if max_tokens is not None and max_tokens > info.max_seq_len:
            raise APIError(400, f"max tokens {max_tokens} is over the engine's context length {info.max_seq_len}",
                           "max_tokens")

    in_flight = [0]  # generation requests accepted and not finished

    def check_queue() -> None:
        """429 when the requests beyond the engine's sequence slots would exceed --max-queue (counted here:
        the scheduler learns of a request only when its thread picks it up)."""
        waiting = max(in_flight[0] - info.max_batch, llm.stats()["waiting"])
        if waiting >= settings.max_queue:
            raise APIError(429, f"the request queue is full ({waiting} waiting, limit {settings.max_queue}); retry later")

    def sampler_extras(req) -> dict:
        """The request's penalties, min_p, min_tokens and logit_bias for SamplingParams (token ids checked)."""
        extras = req.sampler_fields()
        for key in extras.get("logit_bias") or {}:
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < tokenizer.vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {tokenizer.vocab_size})", "logit_bias")
        return extras

    def check_model(model: str | None) -> str:
        """The model name to report; 404 for a name this server does not serve (vLLM's answer)."""
        if model is None or settings.accept_any_model:
            return model or settings.model_name
        if model not in settings.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def fit_max_tokens(prompt_tokens: int, requested: int | None, param: str) -> int:
        """The generation length: the request's (400 when prompt + it exceed the context, as vLLM), else the
        server's default within the context left."""
        room = info.max_seq_len - prompt_tokens
        if requested is not None and requested > room or room < 1:
            asked = f"{prompt_tokens + (requested or 0)} tokens ({prompt_tokens} in the prompt, {requested or 0} in the completion)"
            raise APIError(400, f"This model's maximum context length is {info.max_seq_len} tokens. However, you requested "
                                f"{asked}. Please reduce the length of the prompt or completion.", param)
        return requested if requested is not None else min(settings.default_max_tokens, room)

    def sampling_params(temperature, top_p, top_k, seed, max_tokens: int, stop, logprobs=False, ignore_eos=False,
                        top_logprobs: int = 0, extras: dict | None = None) -> SamplingParams:
        """The request's values over the engine's one set of defaults (`LLM.default_sampling`: the model's
        generation_config.json, else greedy). No seed: the sampler draws a random one (identical unseeded
        sampled requests differ, as in vLLM / OpenAI). extras: penalties, min_p, min_tokens, logit_bias
        (`sampler_extras`)."""
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        extras = dict(extras or {})
        if extras.get("min_tokens", 0) > max_tokens:
            raise APIError(400, f"min_tokens {extras['min_tokens']} is over max_tokens {max_tokens}", "min_tokens")
        try:
            return with_defaults(
                llm.default_sampling, temperature=None if temperature is None else float(temperature),
                top_p=None if top_p is None else float(top_p), top_k=None if top_k is None else max(int(top_k), 0),
                seed=None if seed is None else int(seed), max_tokens=max_tokens, stop=stops, logprobs=bool(logprobs),
                ignore_eos=bool(ignore_eos), top_logprobs=int(top_logprobs or 0), **extras,
            )
        except InputError as exc:
            raise APIError(400, str(exc)) from None

    @dataclass
    class ChatRun:
        """A started chat generation: deltas (the first already arrived), thinking tier (as the engine core
        resolved the request's effort), prompt length (the engine core enforces a forced tool call or JSON
        format)."""

        deltas: AsyncIterator
        tier: str
        prompt_tokens: int

    def prompt_length(messages: list[dict], *, tools, tool_choice, response_format, effort) -> int:
        """Tokens of the rendered conversation (what the runtime will prefill)."""
        return len(llm.render_chat(messages, tools=tools, reasoning_effort=effort, tool_choice=tool_choice,
                                   response_format=response_format))

    async def run_chat(request_id: str, messages: list[dict], sampling: dict, *, max_tokens: int | None, tools, tool_choice,
                       response_format, effort, parallel: bool, max_tokens_param: str = "max_tokens") -> ChatRun:
        """Start a chat generation (`sampling`: sampling_params' arguments but max_tokens). Bad requests raise
        here, before any response byte is sent."""
        prompt_tokens = prompt_length(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                      effort=effort)
        params = sampling_params(**sampling, max_tokens=fit_max_tokens(prompt_tokens, max_tokens, max_tokens_param))
        check_queue()
        stream = llm.chat_stream(
            messages, params, tools=tools, reasoning_effort=effort, tool_choice=tool_choice,
            response_format=response_format, parallel_tool_calls=parallel, request_id=request_id,
        )
        first, deltas = await timed(stream)
        metrics.requests_by_tier.labels(first.thinking_tier).inc()
        return ChatRun(deltas, first.thinking_tier, prompt_tokens)

    async def timed(stream: AsyncIterator) -> tuple[object, AsyncIterator]:
        """Await the first delta (errors surface now), then re-yield all deltas, recording TTFT / ITL: (the first
        delta, all deltas)."""
        start = time.perf_counter()
        in_flight[0] += 1
        try:
            first = await stream.__anext__()
        except BaseException:
            in_flight[0] -= 1
            raise
        metrics.ttft.observe(time.perf_counter() - start)

        async def deltas():
            last = time.perf_counter()
            try:
                yield first
                async for delta in stream:
                    now = time.perf_counter()
                    if delta.token_ids:
                        metrics.itl.observe(now - last)
                        last = now
                    yield delta
            finally:
                in_flight[0] -= 1
                await stream.aclose()  # a client that went away: the runtime aborts the request

        return first, deltas()

    async def final_outputs(streams: list[AsyncIterator], request: Request) -> list:
        """The finished outputs of whole (non-streamed) answers, in order (n choices, a list of prompts). A
        client that disconnects meanwhile aborts them in the runtime at once (as a streamed one does) and
        gets nothing (ClientGone)."""
        outs: list = [None] * len(streams)

        async def drain():
            async for i, d in merged(streams):
                if d.finished:
                    outs[i] = d.output

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return outs
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            for stream in streams:
                await stream.aclose()  # the runtime aborts what has not finished

    async def final_output(deltas: AsyncIterator, request: Request):
        return (await final_outputs([deltas], request))[0]

    async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
        """(stream index, delta) of several delta streams as they arrive; closing it closes them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d, None))
            except Exception as exc:  # handed to the consumer
                await queue.put((i, None, exc))
            else:
                await queue.put((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        try:
            open_streams = len(streams)
            while open_streams:
                i, d, exc = await queue.get()
                if exc is not None:
                    raise exc
                if d is None:
                    open_streams -= 1
                    continue
                yield i, d
        finally:
            for t in tasks:
                t.cancel()
            for t, stream in zip(tasks, streams):
                with suppress(asyncio.CancelledError):
                    await t
                await stream.aclose()

    def finish(route: str, out, tier: str) -> None:
        metrics.requests.labels(route, "200").inc()
        metrics.record_output(out, tier)
        if out.grammar_completed is False:
            metrics.structured_failures.inc()

    def sse(events: AsyncIterator[dict]) -> EventSourceResponse:
        return EventSourceResponse(events, ping=15, sep="\n")

    # --- simple routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "moe-export", "root": str(settings.engine_dir),
                "max_model_len": info.max_seq_len}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [model_card(n) for n in settings.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        metrics.requests.labels("/v1/models/{id}", "200").inc()
        return model_card(model_id)

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("moe-export")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        req = await parse(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`")
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt)
        else:
            check_limits(req.messages, req.tools, None)
            ids = llm.render_chat(
                convert.chat_messages_from_openai(req.messages), tools=convert.openai_tools(req.tools),
                reasoning_effort=convert.openai_effort(req.reasoning_effort), add_generation_prompt=req.add_generation_prompt,
                tool_choice=convert.normalize_tool_choice(req.tool_choice, req.tools), response_format=req.response_format,
            )
        metrics.requests.labels("/tokenize", "200").inc()
        return {"count": len(ids), "max_model_len": info.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        req = await parse(request, DetokenizeRequest)
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
        metrics.requests.labels("/detokenize", "200").inc()
        return {"prompt": tokenizer.decode(req.tokens)}

    # --- chat completions ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = await parse(request, ChatCompletionRequest)
        model = check_model(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        check_limits(req.messages, req.tools, max_tokens)
        extras = sampler_extras(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        messages = convert.chat_messages_from_openai(req.messages)
        tools = convert.openai_tools(req.tools)
        tool_choice = convert.normalize_tool_choice(req.tool_choice, tools)
        effort = convert.openai_effort(req.reasoning_effort)
        request_id = convert.new_id("chatcmpl-")
        runs = []
        try:
            for i in range(req.n):  # n choices: n sequences, each seeded apart (seed + i when a seed is given)
                sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                seed=None if req.seed is None else req.seed + i, stop=req.stop, logprobs=req.logprobs,
                                ignore_eos=req.ignore_eos, top_logprobs=req.top_logprobs or 0, extras=extras)
                runs.append(await run_chat(
                    request_id if req.n == 1 else f"{request_id}-{i}", messages, sampling, max_tokens=max_tokens,
                    tools=tools, tool_choice=tool_choice, response_format=req.response_format, effort=effort,
                    parallel=req.parallel_tool_calls,
                    max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                ))
        except BaseException:
            for run in runs:
                await run.deltas.aclose()
            raise
        if not req.stream:
            outs = await final_outputs([r.deltas for r in runs], request)
            for run, out in zip(runs, outs):
                finish("/v1/chat/completions", out, run.tier)
            pieces = [[tokenizer.decode([t]) for t in out.output_ids] for out in outs] if req.logprobs else None
            return convert.chat_completion_response(outs, request_id=request_id, model=model, logprob_pieces=pieces,
                                                    decode=lambda t: tokenizer.decode([t]))
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events():
            created = int(time.time())

            def chunk(index: int, delta: dict, finish_reason=None, usage=None, choices=True, logprobs=None) -> dict:
                body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
                        if choices else []}
                if usage is not None:
                    body["usage"] = usage
                return {"data": json.dumps(body)}

            for i in range(len(runs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            outs = []
            async for i, d in merged([r.deltas for r in runs]):
                # the step's tokens' logprobs ride on its first chunk (an empty delta when its text is held back)
                logprobs = convert.chat_logprobs([tokenizer.decode([t]) for t in d.token_ids], d.logprobs, d.top_logprobs,
                                                 lambda t: tokenizer.decode([t])) if d.logprobs else None
                if d.reasoning:
                    yield chunk(i, {"reasoning_content": d.reasoning}, logprobs=logprobs)
                    logprobs = None
                if d.content:
                    yield chunk(i, {"content": d.content}, logprobs=logprobs)
                    logprobs = None
                if logprobs is not None:
                    yield chunk(i, {}, logprobs=logprobs)
                if d.finished:
                    out = d.output
                    outs.append(out)
                    finish("/v1/chat/completions", out, runs[i].tier)
                    if out.tool_calls:
                        yield chunk(i, {"tool_calls": [{"index": k, **call} for k, call in enumerate(out.tool_calls)]})
                    yield chunk(i, {}, out.finish_reason)
            if include_usage:
                yield chunk(0, {}, usage=convert.openai_usage(convert.summed_usage(outs)), choices=False)
            yield {"data": "[DONE]"}

        return sse(events())

    # --- completions --------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = await parse(request, CompletionRequest)
        model = check_model(req.model)
        check_limits(None, None, req.max_tokens)
        extras = sampler_extras(req)
        want_logprobs = req.logprobs is not None
        prompts = completion_prompts(req.prompt)
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"prompt: {len(prompts)} prompts x n={req.n} is over the limit of {MAX_CHOICES} choices", "prompt")
        request_id = convert.new_id("cmpl-")
        streams = []
        try:
            for p_index, ids in enumerate(prompts):
                max_tokens = fit_max_tokens(len(ids), req.max_tokens, "max_tokens")
                for j in range(req.n):  # choice index p_index * n + j, as vLLM orders them
                    k = p_index * req.n + j
                    sampling = sampling_params(req.temperature, req.top_p, req.top_k, None if req.seed is None else req.seed + j,
                                               max_tokens, req.stop, want_logprobs, req.ignore_eos,
                                               top_logprobs=req.logprobs or 0, extras=extras)
                    check_queue()
                    streams.append((await timed(llm.generate_stream(
                        ids, sampling, request_id=request_id if len(prompts) * req.n == 1 else f"{request_id}-{k}")))[1])
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        echoes = [tokenizer.decode(ids) if req.echo else "" for ids in prompts for _ in range(req.n)]

        def body(choices: list[dict], usage=None) -> dict:
            b = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                 "choices": choices}
            if usage is not None:
                b["usage"] = usage
            return b

        def choice(i: int, text: str, finish_reason) -> dict:
            return {"index": i, "text": text, "finish_reason": finish_reason, "logprobs": None}

        if not req.stream:
            outs = await final_outputs(streams, request)
            for out in outs:
                finish("/v1/completions", out, "none")
            choices = [choice(i, echoes[i] + visible_text(out.text), out.finish_reason) for i, out in enumerate(outs)]
            if want_logprobs:
                for c, out, echo in zip(choices, outs, echoes):
                    c["logprobs"] = completion_logprobs(out.output_ids, out.logprobs, out.top_logprobs, len(echo))[0]
            return body(choices, convert.openai_usage(convert.summed_usage(outs)))
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events():
            offsets = [len(echo) for echo in echoes]  # each choice's text_offset so far
            for i, echo in enumerate(echoes):
                if echo:
                    yield {"data": json.dumps(body([choice(i, echo, None)]))}
            outs = []
            async for i, d in merged(streams):
                text = visible_text(d.text)
                if d.logprobs:  # the step's tokens with their logprobs, even when their text is held back
                    c = choice(i, text, None)
                    c["logprobs"], offsets[i] = completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, offsets[i])
                    yield {"data": json.dumps(body([c]))}
                elif text:
                    yield {"data": json.dumps(body([choice(i, text, None)]))}
                if d.finished:
                    outs.append(d.output)
                    finish("/v1/completions", d.output, "none")
                    yield {"data": json.dumps(body([choice(i, "", d.output.finish_reason)]))}
            if include_usage:
                yield {"data": json.dumps(body([], convert.openai_usage(convert.summed_usage(outs))))}
            yield {"data": "[DONE]"}

        return sse(events())

    def completion_logprobs(ids: list[int], logprobs, top_logprobs, offset: int) -> tuple[dict, int]:
        """The completions API's logprobs of output tokens `ids` (all of an answer, or a streamed step's): each
        token's text (special tokens by name), logprob, its most likely alternatives ({text: logprob}) and its
        offset in the returned text, which starts at `offset`; and the offset after them."""
        tokens, offsets = [], []
        for t in ids:
            piece = tokenizer.decode([t])
            tokens.append(piece)
            offsets.append(offset)
            offset += len(visible_text(piece))
        tops = top_logprobs or [[] for _ in tokens]
        return {"tokens": tokens, "token_logprobs": [float(lp) for lp in logprobs or []],
                "top_logprobs": [{tokenizer.decode([i]): float(lp) for i, lp in alts} for alts in tops],
                "text_offset": offsets}, offset

    def completion_prompts(prompt) -> list[list[int]]:
        """A completions `prompt` (a string, a list of strings, a token-id list or a list of them) as token-id
        lists, one per prompt."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: give a string, a list of strings, a list of token ids or a list of them", "prompt")
        out = []
        for i, p in enumerate(prompt):
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if not ids:
                raise APIError(400, f"{where}: the prompt is empty", "prompt")
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})", "prompt")
            out.append(ids)
        return out

    special_names = re.compile("|".join(re.escape(n) for n in sorted(tokenizer.special_tokens, key=len, reverse=True)))

    def visible_text(text: str) -> str:
        """Completion text without special-token names (vLLM's skip_special_tokens default): a sampled reserved
        or marker token is not text."""
        return special_names.sub("", text) if text and tokenizer.special_tokens else text

    # --- responses ----------------------------------------------------------------------------------
    @app.post("/v1/responses")
    async def responses(request: Request):
        scope = authorize(request)
        req = await parse(request, ResponsesRequest)
        model = check_model(req.model)
        tools = convert.responses_tools(req.tools)
        check_limits(req.input if isinstance(req.input, list) else None, tools, req.max_output_tokens)
        history: list[dict] = []
        if req.previous_response_id:
            try:
                history = store.history(req.previous_response_id, scope)
            except MissingResponse as gone:
                what = (f"previous_response_id {gone.response_id!r} not found" if gone.response_id == req.previous_response_id
                        else f"previous_response_id {req.previous_response_id!r}: its ancestor {gone.response_id!r} "
                             "was deleted, so the conversation cannot be rebuilt")
                raise APIError(404, what, "previous_response_id") from None
        input_messages = convert.messages_from_responses_input(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        messages = system + history + input_messages
        check_limits(messages, None, None)
        tool_choice = convert.responses_tool_choice(req.tool_choice, tools)
        effort = convert.openai_effort((req.reasoning or {}).get("effort"))
        sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=None, seed=None, stop=None,
                        ignore_eos=req.ignore_eos)
        response_id = convert.new_id("resp_")
        run = await run_chat(
            response_id, messages, sampling, max_tokens=req.max_output_tokens, tools=tools, tool_choice=tool_choice,
            response_format=convert.response_format_from_text(req.text), effort=effort, parallel=req.parallel_tool_calls,
            max_tokens_param="max_output_tokens",
        )
        deltas, tier = run.deltas, run.tier
        effort_name = (req.reasoning or {}).get("effort") if isinstance(effort, str) else tier

        def complete(out) -> dict:
            status = "incomplete" if out.finish_reason == "length" else "completed"
            obj = convert.responses_object(response_id, req, model=model, status=status,
                                           output=convert.responses_output_items(out), usage=out.usage, effort=effort_name)
            if req.store:
                items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
                store.put(StoredResponse(response_id, req.previous_response_id, items, input_messages, out.message(), obj), scope)
            finish("/v1/responses", out, tier)
            return obj

        if not req.stream:
            return complete(await final_output(deltas, request))

        async def events():
            seq = 0

            def event(kind: str, **fields) -> dict:
                nonlocal seq
                seq += 1
                return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq - 1, **fields})}

            shell = convert.responses_object(response_id, req, model=model, status="in_progress", output=[], usage=None,
                                             effort=effort_name)
            yield event("response.created", response=shell)
            yield event("response.in_progress", response=shell)
            open_item: dict | None = None
            output_index = -1
            out = None

            def close_item():
                item, text = open_item["item"], open_item["text"]
                if item["type"] == "reasoning":
                    item["content"] = [{"type": "reasoning_text", "text": text}]
                    yield event("response.reasoning_text.done", item_id=item["id"], output_index=output_index,
                                content_index=0, text=text)
                else:
                    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    item["content"] = [part]
                    yield event("response.output_text.done", item_id=item["id"], output_index=output_index,
                                content_index=0, text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=item["id"], output_index=output_index,
                                content_index=0, part=part)
                item["status"] = "completed"
                yield event("response.output_item.done", output_index=output_index, item=item)

            async for d in deltas:
                for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
                    if not text:
                        continue
                    if open_item is None or open_item["item"]["type"] != kind:
                        if open_item is not None:
                            for e in close_item():
                                yield e
                        output_index += 1
                        if kind == "reasoning":
                            item = {"type": "reasoning", "id": convert.new_id("rs_"), "summary": [], "content": [],
                                    "status": "in_progress"}
                        else:
                            item = {"type": "message", "id": convert.new_id("msg_"), "role": "assistant", "content": [],
                                    "status": "in_progress"}
                        open_item = {"item": item, "text": ""}
                        yield event("response.output_item.added", output_index=output_index, item=item)
                        if kind == "message":
                            yield event("response.content_part.added", item_id=item["id"], output_index=output_index,
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    open_item["text"] += text
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield event(name, item_id=open_item["item"]["id"], output_index=output_index, content_index=0,
                                delta=text, **extra)
                if d.finished:
                    out = d.output
            if open_item is not None:
                for e in close_item():
                    yield e
            obj = complete(out)
            for call_item in (i for i in obj["output"] if i["type"] == "function_call"):
                output_index += 1
                yield event("response.output_item.added", output_index=output_index,
                            item={**call_item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=call_item["id"], output_index=output_index,
                            delta=call_item["arguments"])
                yield event("response.function_call_arguments.done", item_id=call_item["id"], output_index=output_index,
                            arguments=call_item["arguments"], name=call_item["name"])
                yield event("response.output_item.done", output_index=output_index, item=call_item)
            yield event("response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj)

        return sse(events())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        scope = authorize(request)
        rec = store.get(response_id, scope)
        if rec is None:
            raise APIError(404, f"response {response_id!r} not found")
        metrics.requests.labels("/v1/responses/{id}", "200").inc()
        return rec.response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request):
        scope = authorize(request)
        rec = store.get(response_id, scope)
        if rec is None:
            raise APIError(404, f"response {response_id!r} not found")
        items = convert.responses_input_items(rec.input_items, response_id)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: must be asc or desc, got {order!r}", "order")
        if order == "desc":
            items = items[::-1]
        metrics.requests.labels("/v1/responses/{id}/input_items", "200").inc()
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        scope = authorize(request)
        if not store.delete(response_id, scope):
            raise APIError(404, f"response {response_id!r} not found")
        metrics.requests.labels("/v1/responses/{id}", "200").inc()
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # --- anthropic messages -------------------------------------------------------------------------
    def anthropic_chat(req) -> tuple[list[dict], list | None, object, object]:
        """(messages, tools, tool_choice, effort) of a Messages or count_tokens body."""
        messages = convert.messages_from_anthropic(req.system, req.messages)
        tools = convert.anthropic_tools(req.tools)
        return messages, tools, convert.anthropic_tool_choice(req.tool_choice, tools), convert.anthropic_effort(req.thinking)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request):
        authorize(request)
        req = await parse(request, AnthropicCountTokensRequest)
        check_model(req.model)
        check_limits(req.messages, req.tools, None)
        messages, tools, tool_choice, effort = anthropic_chat(req)
        count = prompt_length(messages, tools=tools, tool_choice=tool_choice, response_format=None, effort=effort)
        metrics.requests.labels("/v1/messages/count_tokens", "200").inc()
        return {"input_tokens": count}

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        authorize(request)
        req = await parse(request, AnthropicMessagesRequest)
        model = check_model(req.model)
        check_limits(req.messages, req.tools, req.max_tokens)
        messages, tools, tool_choice, effort = anthropic_chat(req)
        if isinstance(effort, int) and effort >= req.max_tokens:
            raise APIError(400, f"max_tokens must be greater than thinking.budget_tokens ({req.max_tokens} <= {effort})",
                           "max_tokens")
        parallel = not (req.tool_choice or {}).get("disable_parallel_tool_use", False)
        sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=None, stop=req.stop_sequences)
        message_id = convert.new_id("msg_")
        run = await run_chat(
            message_id, messages, sampling, max_tokens=req.max_tokens, tools=tools, tool_choice=tool_choice,
            response_format=None, effort=effort, parallel=parallel,
        )
        deltas, tier = run.deltas, run.tier
        if not req.stream:
            out = await final_output(deltas, request)
            finish("/v1/messages", out, tier)
            return convert.anthropic_message(out, message_id=message_id, model=model)

        async def events():
            def event(kind: str, **fields) -> dict:
                return {"event": kind, "data": json.dumps({"type": kind, **fields})}

            yield event("message_start", message={
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}})
            index, open_kind, out = -1, None, None
            async for d in deltas:
                for kind, text in (("thinking", d.reasoning), ("text", d.content)):
                    if not text:
                        continue
                    if open_kind != kind:
                        if open_kind == "thinking":
                            yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
                        if open_kind is not None:
                            yield event("content_block_stop", index=index)
                        index += 1
                        open_kind = kind
                        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                        yield event("content_block_start", index=index, content_block=block)
                    delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
                    yield event("content_block_delta", index=index, delta=delta)
                if d.finished:
                    out = d.output
            if open_kind == "thinking":
                yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
            if open_kind is not None:
                yield event("content_block_stop", index=index)
            finish("/v1/messages", out, tier)
            for call in out.tool_calls or []:
                index += 1
                yield event("content_block_start", index=index,
                            content_block={"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
                yield event("content_block_stop", index=index)
            yield event("message_delta", delta=convert.anthropic_stop(out), usage=convert.anthropic_usage(out.usage))
            yield event("message_stop")

        return sse(events())

    return BodySizeLimit(app, settings.max_body_bytes)


def _route_of(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"

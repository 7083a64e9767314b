"""The HTTP application: OpenAI Chat Completions / Completions / Responses, Anthropic Messages, vLLM's
/tokenize and /detokenize, /v1/models, /health and /metrics, over one `AsyncLLM`.

Every request's generation goes through the runtime's streaming API (so time to first token and
inter-token latency are measured the same way for streamed and whole responses). Errors use OpenAI's
shape on OpenAI routes and Anthropic's on /v1/messages; no handler ever returns a traceback.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_export.export.errors import InputError
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.metrics import ServerMetrics
from moe_export.runtime.entrypoints.server.protocol import (
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from moe_export.runtime.core.structured import GrammarLogitsProcessor, GrammarVocab, structural_tag_for
from moe_export.runtime.entrypoints.server.store import ResponseStore, StoredResponse, key_scope

log = logging.getLogger("moe_export.serve")

OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                      405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                      500: "server_error", 503: "server_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


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
    default_effort: str = "max"
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_messages: int = 2048
    max_tools: int = 128
    default_max_tokens: int = 1024
    model_name: str = field(default="")

    def __post_init__(self) -> None:
        self.engine_dir = Path(self.engine_dir)
        if not self.model_name:
            self.model_name = self.engine_dir.resolve().name


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs from the engine's config.json: context limit, sequence slots, thinking caps,
    logits width."""

    max_seq_len: int
    max_batch: int
    thinking_caps: dict
    vocab_size: int

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> EngineInfo:
        cfg = json.loads((Path(engine_dir) / "config.json").read_text())
        pre = cfg.get("pretrained_config", {})
        text = pre.get("text_config", pre)
        limits = cfg["limits"]
        return cls(int(limits["max_seq_len"]), int(limits["max_batch"]), dict(cfg.get("thinking") or {}),
                   int(text["vocab_size"]))


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
    from moe_export.runtime.chat import prompt_starts_in_reasoning
    from moe_export.runtime.core.budget import resolve_thinking
    from moe_export.runtime.sampling import SamplingParams

    tokenizer, family = llm.tokenizer, llm.family
    store = ResponseStore(settings.store_path)
    metrics = ServerMetrics(llm.stats)
    key_digests = [_key_digest(k) for k in settings.api_keys]
    grammar_vocab: list[GrammarVocab] = []  # built on the first constrained request

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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(request, 500, f"internal error ({type(exc).__name__}); see the server log")

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

    def sampling_params(temperature, top_p, top_k, seed, max_tokens, stop, logprobs=False, ignore_eos=False) -> SamplingParams:
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return SamplingParams(
            temperature=1.0 if temperature is None else float(temperature), top_p=1.0 if top_p is None else float(top_p),
            top_k=max(int(top_k or 0), 0), seed=int(seed or 0), max_tokens=int(max_tokens or settings.default_max_tokens),
            stop=stops, logprobs=bool(logprobs), ignore_eos=ignore_eos,
        )

    def grammar_for(tools, tool_choice, response_format, thinking: bool, parallel: bool):
        tag = structural_tag_for(
            family, tools=tools, tool_choice=tool_choice, response_format=response_format, thinking=thinking,
            starts_in_reasoning=prompt_starts_in_reasoning(family, thinking), parallel_tool_calls=parallel,
        )
        if tag is None:
            return None
        if not grammar_vocab:
            grammar_vocab.append(GrammarVocab(tokenizer, family, info.vocab_size))
        vocab = grammar_vocab[0]
        return GrammarLogitsProcessor(vocab, vocab.compile(tag))

    async def run_chat(request_id: str, messages: list[dict], sampling: SamplingParams, *, tools, tool_choice,
                       response_format, effort, parallel: bool) -> tuple[AsyncIterator, object, str]:
        """Start a chat generation: (delta iterator whose first delta has already arrived, grammar
        processor or None, tier). Bad requests raise here, before any response byte is sent."""
        plan = resolve_thinking(effort, info.thinking_caps, settings.default_effort)
        processor = grammar_for(tools, tool_choice, response_format, plan.enabled, parallel)
        check_queue()
        stream = llm.chat_stream(
            messages, sampling, tools=tools, reasoning_effort=effort, tool_choice=tool_choice,
            response_format=response_format, logits_processors=[processor] if processor else None, request_id=request_id,
        )
        metrics.requests_by_tier.labels(plan.tier).inc()
        return await timed(stream), processor, plan.tier

    async def timed(stream: AsyncIterator) -> AsyncIterator:
        """Await the first delta (errors surface now), then re-yield all deltas, recording TTFT / ITL."""
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

        return deltas()

    async def final_output(deltas: AsyncIterator):
        out = None
        async for delta in deltas:
            if delta.finished:
                out = delta.output
        return out

    def finish(route: str, out, tier: str, processor) -> None:
        metrics.requests.labels(route, "200").inc()
        metrics.record_output(out, tier)
        if processor is not None and not processor.completed:
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

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "moe-export", "max_model_len": info.max_seq_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        req = await parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`")
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt)
        else:
            check_limits(req.messages, req.tools, None)
            ids = llm.render_chat(
                convert.chat_messages_from_openai(req.messages), tools=convert.openai_tools(req.tools),
                reasoning_effort=req.reasoning_effort, add_generation_prompt=req.add_generation_prompt,
                tool_choice=convert.normalize_tool_choice(req.tool_choice, req.tools), response_format=req.response_format,
            )
        metrics.requests.labels("/tokenize", "200").inc()
        return {"count": len(ids), "max_model_len": info.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        req = await parse(request, DetokenizeRequest)
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
        max_tokens = req.max_completion_tokens or req.max_tokens
        check_limits(req.messages, req.tools, max_tokens)
        messages = convert.chat_messages_from_openai(req.messages)
        tools = convert.openai_tools(req.tools)
        tool_choice = convert.normalize_tool_choice(req.tool_choice, tools)
        sampling = sampling_params(req.temperature, req.top_p, req.top_k, req.seed, max_tokens, req.stop, req.logprobs,
                                   req.ignore_eos)
        request_id = convert.new_id("chatcmpl-")
        deltas, processor, tier = await run_chat(
            request_id, messages, sampling, tools=tools, tool_choice=tool_choice, response_format=req.response_format,
            effort=req.reasoning_effort, parallel=req.parallel_tool_calls,
        )
        model = req.model or settings.model_name
        if not req.stream:
            out = await final_output(deltas)
            finish("/v1/chat/completions", out, tier, processor)
            pieces = [tokenizer.decode([t]) for t in out.output_ids] if req.logprobs else None
            return convert.chat_completion_response(out, request_id=request_id, model=model, logprob_pieces=pieces)
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events():
            created = int(time.time())

            def chunk(delta: dict, finish_reason=None, usage=None, choices=True) -> dict:
                body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
                        if choices else []}
                if usage is not None:
                    body["usage"] = usage
                return {"data": json.dumps(body)}

            yield chunk({"role": "assistant", "content": ""})
            out = None
            async for d in deltas:
                if d.reasoning:
                    yield chunk({"reasoning_content": d.reasoning})
                if d.content:
                    yield chunk({"content": d.content})
                if d.finished:
                    out = d.output
            finish("/v1/chat/completions", out, tier, processor)
            if out.tool_calls:
                yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(out.tool_calls)]})
            yield chunk({}, out.finish_reason)
            if include_usage:
                yield chunk({}, usage=convert.openai_usage(out.usage), choices=False)
            yield {"data": "[DONE]"}

        return sse(events())

    # --- completions --------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = await parse(request, CompletionRequest)
        check_limits(None, None, req.max_tokens)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (n=1)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
            if bad or not prompt:
                raise APIError(400, f"prompt: token ids must be a non-empty list in [0, {tokenizer.vocab_size})", "prompt")
        sampling = sampling_params(req.temperature, req.top_p, req.top_k, req.seed, req.max_tokens, req.stop,
                                   req.logprobs is not None, req.ignore_eos)
        request_id = convert.new_id("cmpl-")
        check_queue()
        deltas = await timed(llm.generate_stream(prompt, sampling, request_id=request_id))
        model = req.model or settings.model_name
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if req.echo else ""

        def body(text: str, finish_reason, usage=None) -> dict:
            b = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                 "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
            if usage is not None:
                b["usage"] = usage
            return b

        if not req.stream:
            out = await final_output(deltas)
            finish("/v1/completions", out, "none", None)
            return body(echo + out.text, out.finish_reason, convert.openai_usage(out.usage))
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events():
            if echo:
                yield {"data": json.dumps(body(echo, None))}
            async for d in deltas:
                if d.text:
                    yield {"data": json.dumps(body(d.text, None))}
                if d.finished:
                    out = d.output
                    finish("/v1/completions", out, "none", None)
                    yield {"data": json.dumps(body("", out.finish_reason,
                                                   convert.openai_usage(out.usage) if include_usage else None))}
            yield {"data": "[DONE]"}

        return sse(events())

    # --- responses ----------------------------------------------------------------------------------
    @app.post("/v1/responses")
    async def responses(request: Request):
        scope = authorize(request)
        req = await parse(request, ResponsesRequest)
        tools = convert.responses_tools(req.tools)
        check_limits(req.input if isinstance(req.input, list) else None, tools, req.max_output_tokens)
        history: list[dict] = []
        if req.previous_response_id:
            found = store.history(req.previous_response_id, scope)
            if found is None:
                raise APIError(404, f"previous_response_id {req.previous_response_id!r} not found", "previous_response_id")
            history = found
        input_messages = convert.messages_from_responses_input(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        messages = system + history + input_messages
        check_limits(messages, None, None)
        tool_choice = convert.responses_tool_choice(req.tool_choice, tools)
        effort = (req.reasoning or {}).get("effort")
        sampling = sampling_params(req.temperature, req.top_p, None, None, req.max_output_tokens, None,
                                   ignore_eos=req.ignore_eos)
        response_id = convert.new_id("resp_")
        deltas, processor, tier = await run_chat(
            response_id, messages, sampling, tools=tools, tool_choice=tool_choice,
            response_format=convert.response_format_from_text(req.text), effort=effort, parallel=req.parallel_tool_calls,
        )
        model = req.model or settings.model_name
        effort_name = effort if isinstance(effort, str) else tier

        def complete(out) -> dict:
            status = "incomplete" if out.finish_reason == "length" else "completed"
            obj = convert.responses_object(response_id, req, model=model, status=status,
                                           output=convert.responses_output_items(out), usage=out.usage, effort=effort_name)
            if req.store:
                items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
                store.put(StoredResponse(response_id, req.previous_response_id, items, input_messages, out.message(), obj), scope)
            finish("/v1/responses", out, tier, processor)
            return obj

        if not req.stream:
            return complete(await final_output(deltas))

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

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        scope = authorize(request)
        if not store.delete(response_id, scope):
            raise APIError(404, f"response {response_id!r} not found")
        metrics.requests.labels("/v1/responses/{id}", "200").inc()
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # --- anthropic messages -------------------------------------------------------------------------
    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        authorize(request)
        req = await parse(request, AnthropicMessagesRequest)
        check_limits(req.messages, req.tools, req.max_tokens)
        messages = convert.messages_from_anthropic(req.system, req.messages)
        tools = convert.anthropic_tools(req.tools)
        tool_choice = convert.anthropic_tool_choice(req.tool_choice, tools)
        parallel = not (req.tool_choice or {}).get("disable_parallel_tool_use", False)
        sampling = sampling_params(req.temperature, req.top_p, req.top_k, None, req.max_tokens, req.stop_sequences)
        message_id = convert.new_id("msg_")
        deltas, processor, tier = await run_chat(
            message_id, messages, sampling, tools=tools, tool_choice=tool_choice, response_format=None,
            effort=convert.anthropic_effort(req.thinking), parallel=parallel,
        )
        model = req.model or settings.model_name
        if not req.stream:
            out = await final_output(deltas)
            finish("/v1/messages", out, tier, processor)
            return convert.anthropic_message(out, message_id=message_id, model=model)

        async def events():
            def event(kind: str, **fields) -> dict:
                return {"event": kind, "data": json.dumps({"type": kind, **fields})}

            yield event("message_start", message={
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}})
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
            finish("/v1/messages", out, tier, processor)
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

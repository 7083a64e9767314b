"""The serving layer below HTTP: a plain Python object over one `AsyncLLM` that the routes (and `batch`, in
process) call. It checks a request's limits, builds its sampling parameters, starts its generations and
collects or streams their deltas, recording the metrics; the route modules shape the answers.

Every generation goes through the runtime's streaming API (so time to first token and inter-token latency are
measured the same way for streamed and whole answers)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.server.errors import APIError, ClientGone, shown
from moe_export.runtime.entrypoints.server.image_fetch import ImageFetcher
from moe_export.runtime.entrypoints.server.metrics import ServerMetrics
from moe_export.runtime.entrypoints.server.store import ResponseStore
from moe_export.runtime.client.protocol import EngineClient
from moe_export.runtime.image_urls import private_allowed, public_address
from moe_export.runtime.processor import RenderedChat
from moe_export.runtime.request_options import RequestOptions, parse_request_options

MAX_CHOICES = 64  # most sequences one completions request may start (prompts x n)
DISCONNECT_POLL_S = 0.1  # how often a whole (non-streamed) answer checks that its client is still there
SEED_MOD = 1 << 64  # seeds are unsigned 64-bit integers; choice i of a seeded request uses seed + i (mod 2^64)

Disconnected = Callable[[], Awaitable[bool]] | None  # "has the client gone?" (None: nobody to lose, e.g. batch)


@dataclass
class ServerSettings:
    """Serving limits and options. api_keys: accepted keys (empty: no auth). max_body_bytes: request body
    limit (413 above). max_queue: waiting requests before 429. default_max_tokens: generation length when a
    request gives none. allow_image_urls: fetch http(s) image parts (`image_fetch`), within
    image_fetch_timeout_s seconds in all and image_fetch_max_bytes bytes, from public addresses only unless
    allow_private_image_urls (`runtime.image_urls`)."""

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
    allow_image_urls: bool = False
    allow_private_image_urls: bool = False
    image_fetch_timeout_s: float = 10.0
    image_fetch_max_bytes: int = 32 << 20

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


@dataclass
class ChatRun:
    """A started chat generation: deltas (the first already arrived), thinking tier (as the engine core
    resolved the request's effort), prompt length (the engine core enforces a forced tool call or JSON
    format)."""

    deltas: AsyncIterator
    tier: str
    prompt_tokens: int


class Service:
    """The served model: `llm` (a started engine client: `AsyncLLM`), the serving `settings`, the engine's limits (`info`), the
    Responses store and the metrics."""

    def __init__(self, llm: EngineClient, settings: ServerSettings, info: EngineInfo | None = None) -> None:
        self.llm = llm
        self.settings = settings
        self.info = info or EngineInfo.from_engine_dir(settings.engine_dir)
        self.tokenizer = llm.tokenizer
        self.vocab_size = min(self.tokenizer.vocab_size, self.info.vocab_size)  # ids a prompt may hold
        self.store = ResponseStore(settings.store_path)
        self.metrics = ServerMetrics(llm.stats)
        self.in_flight = 0  # generation requests accepted and not finished
        self.images = ImageFetcher(settings.image_fetch_timeout_s, settings.image_fetch_max_bytes,
                                   private_allowed if settings.allow_private_image_urls else public_address)
        # one worker thread for the CPU-bound work of requests (JSON decoding and validation, tokenizing, chat
        # rendering and image decoding): the event loop stays free for other clients (/health among them), and
        # the renderer runs one request at a time, as it did on the loop
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="moe-export-request")

    @property
    def healthy(self) -> bool:
        """The engine core can run requests (False once it died: /health answers 503, the server exits)."""
        return bool(self.llm.healthy)

    async def aclose(self) -> None:
        """Close the store and the image downloads (the runtime is its owner's to shut down)."""
        self.store.close()
        await self.images.aclose()
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` run in the request worker thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    async def inline_image_urls(self, messages: list[dict]) -> list[dict]:
        """With allow_image_urls, `messages` with their http(s) images downloaded (off the runtime's thread and
        without blocking the event loop); otherwise as given (the runtime refuses URLs)."""
        return await self.images.inline(messages) if self.settings.allow_image_urls else messages

    # ---- request checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The model name to report; 404 for a name this server does not serve (vLLM's answer)."""
        if model is None or self.settings.accept_any_model:
            return model or self.settings.model_name
        if model not in self.settings.served_model_names:
            raise APIError(404, f"The model `{shown(model)}` does not exist.", "model")
        return model

    def check_limits(self, messages: list | None, tools: list | None, max_tokens: int | None,
                     messages_field: str = "messages") -> None:
        limits = self.settings
        if messages is not None and len(messages) > limits.max_messages:
            raise APIError(400, f"{messages_field}: {len(messages)} messages is over the limit of {limits.max_messages}",
                           messages_field)
        if tools is not None and len(tools) > limits.max_tools:
            raise APIError(400, f"tools: {len(tools)} tools is over the limit of {limits.max_tools}", "tools")
        if max_tokens is not None and max_tokens > self.info.max_seq_len:
            raise APIError(400, f"max tokens {max_tokens} is over the engine's context length {self.info.max_seq_len}",
                           "max_tokens")

    def check_queue(self) -> None:
        """429 when the requests beyond the engine's sequence slots would exceed max_queue (counted here: the
        scheduler learns of a request only when its thread picks it up)."""
        waiting = max(self.in_flight - self.info.max_batch, self.llm.stats()["waiting"])
        if waiting >= self.settings.max_queue:
            raise APIError(429, f"the request queue is full ({waiting} waiting, limit {self.settings.max_queue}); retry later")

    def check_token_ids(self, ids: list[int], where: str, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", param)

    def sampler_extras(self, req) -> dict:
        """The request's penalties, min_p, min_tokens and logit_bias for SamplingParams (token ids checked)."""
        extras = req.sampler_fields()
        for key in extras.get("logit_bias") or {}:
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {self.vocab_size})", "logit_bias")
        return extras

    def fit_max_tokens(self, prompt_tokens: int, requested: int | None, param: str) -> int:
        """The generation length: the request's (400 when prompt + it exceed the context, as vLLM), else the
        server's default within the context left."""
        limit = self.info.max_seq_len
        room = limit - prompt_tokens
        if requested is not None and requested > room or room < 1:
            asked = f"{prompt_tokens + (requested or 0)} tokens ({prompt_tokens} in the prompt, {requested or 0} in the completion)"
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{asked}. Please reduce the length of the prompt or completion.", param)
        return requested if requested is not None else min(self.settings.default_max_tokens, room)

    def request_options(self, temperature, top_p, top_k, seed, max_tokens: int, stop, logprobs=False, ignore_eos=False,
                        top_logprobs: int = 0, extras: dict | None = None, session: dict | None = None) -> RequestOptions:
        """The request's sampling values over the engine's one set of defaults (`LLM.default_sampling`: the model's
        generation_config.json, else greedy) and the session it names. No seed: the sampler draws a random one
        (identical unseeded sampled requests differ, as in vLLM / OpenAI). extras: penalties, min_p, min_tokens,
        logit_bias (`sampler_extras`); session: the request's `request_options.SESSION_KEYS` fields."""
        extras = dict(extras or {})
        if extras.get("min_tokens", 0) > max_tokens:
            raise APIError(400, f"min_tokens {extras['min_tokens']} is over max_tokens {max_tokens}", "min_tokens")
        seed = None if seed is None else seed % SEED_MOD
        options = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
                       stop=[] if stop is None else stop, logprobs=bool(logprobs), ignore_eos=bool(ignore_eos),
                       top_logprobs=int(top_logprobs or 0), **extras, **(session or {}))
        try:
            return parse_request_options(options, self.llm.default_sampling)
        except InputError as exc:  # (`SamplingValueError` names its field)
            raise APIError(400, str(exc), getattr(exc, "field", None)) from None

    # ---- generation --------------------------------------------------------------------------------
    async def render(self, messages: list[dict], *, tools, tool_choice, response_format, effort) -> RenderedChat:
        """A conversation rendered once per request (its images decoded; `prompt_ids` is what the runtime will
        prefill), in the request worker, off the event loop."""
        return await self.off_loop(self.llm.processor.render, messages, tools=tools, reasoning_effort=effort,
                                   tool_choice=tool_choice, response_format=response_format)

    async def run_chat(self, request_id: str, rendered: RenderedChat, sampling: dict, *,
                       max_tokens: int | None, parallel: bool, max_tokens_param: str = "max_tokens") -> ChatRun:
        """Start one chat generation (a choice) of a rendered conversation (`sampling`: request_options' arguments
        but max_tokens). Bad requests raise here, before any response byte is sent."""
        prompt_tokens = len(rendered.prompt_ids)
        opts = self.request_options(**sampling, max_tokens=self.fit_max_tokens(prompt_tokens, max_tokens, max_tokens_param))
        request = await self.off_loop(  # its budget, parser and grammar (compiled for a forced tool call / format)
            self.llm.processor.chat_request, rendered, opts.sampling, parallel_tool_calls=parallel, request_id=request_id)
        request.session = opts.session
        stream = self.llm.stream(request)
        try:  # the queue check and the count in timed() with no await between them: requests rendered at once
            self.check_queue()  # cannot all pass the check before any of them is counted
        except APIError:
            await stream.aclose()  # not started: nothing was submitted
            raise
        first, deltas = await self.timed(stream)
        self.metrics.requests_by_tier.labels(first.thinking_tier).inc()
        return ChatRun(deltas, first.thinking_tier, prompt_tokens)

    async def timed(self, stream: AsyncIterator) -> tuple[object, AsyncIterator]:
        """Await the first delta (errors surface now), then re-yield all deltas, recording TTFT / ITL: (the first
        delta, all deltas)."""
        start = time.perf_counter()
        self.in_flight += 1
        try:
            first = await stream.__anext__()
        except BaseException:
            self.in_flight -= 1
            raise
        self.metrics.ttft.observe(time.perf_counter() - start)
        return first, self._timed_deltas(first, stream)

    async def _timed_deltas(self, first, stream: AsyncIterator) -> AsyncIterator:
        last = time.perf_counter()
        try:
            yield first
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    self.metrics.itl.observe(now - last)
                    last = now
                yield delta
        finally:
            self.in_flight -= 1
            await stream.aclose()  # a client that went away: the runtime aborts the request

    async def final_outputs(self, streams: list[AsyncIterator], disconnected: Disconnected) -> list:
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
                if disconnected is not None and await disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            for stream in streams:
                await stream.aclose()  # the runtime aborts what has not finished

    async def final_output(self, deltas: AsyncIterator, disconnected: Disconnected):
        return (await self.final_outputs([deltas], disconnected))[0]

    def finish(self, route: str, out, tier: str) -> None:
        """Count a finished generation of `route` (status 200, tokens, tool calls, structured-output failures)."""
        self.metrics.requests.labels(route, "200").inc()
        self.metrics.record_output(out, tier)
        if out.grammar_completed is False:
            self.metrics.structured_failures.inc()

    def visible_text(self, text: str) -> str:
        """Completion text as every entry point shows it (`Tokenizer.visible_text`: no special-token names)."""
        return self.tokenizer.visible_text(text)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


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

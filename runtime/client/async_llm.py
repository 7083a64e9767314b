"""`AsyncLLM`: the asyncio engine client (an `EngineClient`): a background thread runs the engine core of an
`LLM`; requests and aborts reach it through a command list, deltas come back on per-request queues."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from pathlib import Path

from moe_export.common.errors import EngineDead, InputError, RequestFailed
from moe_export.runtime.client.llm import LLM
from moe_export.runtime.client.request_core import ChatOutput, StreamDelta, Tracked
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams


class AsyncLLM:
    """asyncio engine client (an `EngineClient`): one background thread owns the engine core and steps while there
    is work; requests and aborts reach it through a command list, deltas come back on per-request queues.

    A request the engine fails ends its stream with `RequestFailed`; the others go on. When the engine core dies
    (`healthy` False, `fatal_error` its `EngineDead`), every open stream and every later request end with that
    EngineDead (a server answers /health with 503 and exits non-zero)."""

    def __init__(self, engine_dir_or_llm: str | Path | LLM, **kwargs) -> None:
        self._owns_llm = not isinstance(engine_dir_or_llm, LLM)
        self.llm = LLM(engine_dir_or_llm, **kwargs) if self._owns_llm else engine_dir_or_llm
        self.tokenizer, self.family = self.llm.tokenizer, self.llm.family
        self.processor = self.llm.processor  # requests -> engine requests (the front ends call it off the loop)
        self.default_sampling = self.llm.default_sampling  # the engine's one set of sampling defaults
        self._core = self.llm._root()
        self._cv = threading.Condition()
        self._commands: list = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closing = False
        self._core.on_dead.append(self._end_streams)  # a rank's fault (the scheduler thread may wait in a collective)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="moe-export-request")
        self._thread = threading.Thread(target=self._loop, name="moe-export-scheduler", daemon=True)
        self._thread.start()

    # ---- scheduler thread -----------------------------------------------------------------------

    @property
    def fatal_error(self) -> BaseException | None:
        """What killed the engine core (an `EngineDead`), or None while it serves."""
        return self._core.fatal_error

    @property
    def healthy(self) -> bool:
        """Whether the engine core can serve requests (False once it is dead)."""
        return self._core.fatal_error is None

    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # the engine core died: every open stream ends with its EngineDead
            self._end_streams(self._core.die(exc))

    def _end_streams(self, dead: EngineDead) -> None:
        """Every open stream ends with `dead`."""
        with self._cv:
            for rid in list(self._queues):
                self._push(rid, dead)

    def _turn(self) -> bool:
        """Run the queued commands and one step; False when the thread is done (shut down)."""
        with self._cv:
            while not self._commands and not self._core.has_work and not self._closing:
                self._cv.wait()
            commands, self._commands = self._commands, []
            if self._closing and not commands:
                for rid in list(self._queues):
                    self._core.abort(rid)
        for command in commands:
            command()
        deltas = self._core.step() if self._core.has_work else []
        for d in deltas:
            self._push(d.request_id, d)
        return not (self._closing and not self._core.has_work and not self._commands)

    def _push(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._queues[request_id]
        loop, queue = target
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _command(self, fn) -> None:
        with self._cv:
            if self._core.fatal_error is not None:
                raise self._core.fatal_error
            if self._closing:
                raise InputError("the engine is shut down")
            self._commands.append(fn)
            self._cv.notify()

    # ---- asyncio API ----------------------------------------------------------------------------

    async def stream(self, tracked: Tracked, logits_processors: list[LogitsProcessor] | None = None
                     ) -> AsyncIterator[StreamDelta]:
        """Run an engine request (`InputProcessor`'s): its deltas, the last one finished with its output."""
        processors = logits_processors
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = tracked.request_id
        if rid in self._queues:
            raise InputError(f"request id {rid!r} is already in use")
        self._queues[rid] = (loop, queue)

        def submit() -> None:
            try:
                self._core.submit(tracked, processors)
            except (InputError, EngineDead) as exc:
                self._push(rid, exc)
            except Exception as exc:  # e.g. its detokenizer could not be made: this request fails alone
                failed = RequestFailed(f"request {rid} could not be started: {type(exc).__name__}: {exc}")
                failed.__cause__ = exc
                self._push(rid, failed)

        finished = False
        try:
            self._command(submit)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error:
                    finished = True
                    raise RequestFailed(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (e.g. a client disconnect): free the request's state now
                self._queues.pop(rid, None)
                self.abort(rid)

    def chat_stream(self, messages: list[dict], sampling: SamplingParams | None = None, *, tools=None,
                    reasoning_effort=None, tool_choice=None, response_format=None, parallel_tool_calls: bool = True,
                    logits_processors: list[LogitsProcessor] | None = None, request_id: str | None = None
                    ) -> AsyncIterator[StreamDelta]:
        """Stream one chat's deltas; the last one has finished=True and the ChatOutput."""
        tracked = self.processor.chat(messages, sampling, tools=tools, reasoning_effort=reasoning_effort,
                                        tool_choice=tool_choice, response_format=response_format,
                                        parallel_tool_calls=parallel_tool_calls, request_id=request_id)
        return self.stream(tracked, logits_processors)

    def render_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """`LLM.render_chat`: the prompt ids a chat request would run."""
        return self.processor.render(messages, **kwargs).prompt_ids

    def generate_stream(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                        request_id: str | None = None, logits_processors: list[LogitsProcessor] | None = None
                        ) -> AsyncIterator[StreamDelta]:
        """Stream one prompt's continuation."""
        return self.stream(self.processor.generate(prompt, sampling, request_id), logits_processors)

    async def off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` in this client's request worker (one thread: requests are processed one at a time,
        as the server's worker does), awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    async def chat(self, messages: list[dict], sampling: SamplingParams | None = None, *,
                   logits_processors: list[LogitsProcessor] | None = None, **kwargs) -> ChatOutput:
        """One conversation's output (processed off the event loop: `off_loop`)."""
        request = await self.off_loop(self.processor.chat, messages, sampling, **kwargs)
        async for delta in self.stream(request, logits_processors):
            if delta.finished:
                return delta.output
        raise RuntimeError("the stream ended without a final delta")

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                       request_id: str | None = None, logits_processors: list[LogitsProcessor] | None = None
                       ) -> ChatOutput:
        """One prompt's output (tokenized off the event loop: `off_loop`)."""
        request = await self.off_loop(self.processor.generate, prompt, sampling, request_id)
        async for delta in self.stream(request, logits_processors):
            if delta.finished:
                return delta.output
        raise RuntimeError("the stream ended without a final delta")

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream ends with a final delta whose finish_reason is "abort"."""
        with self._cv:
            if self._closing or self._core.fatal_error is not None:
                return
            self._commands.append(lambda: self._core.abort(request_id))
            self._cv.notify()

    def stats(self) -> dict:
        return self._core.stats()

    def warm_up(self) -> int:
        """`LLM.warm_up` on the LLM this serves (before any request: its thread is idle); the engine steps it ran."""
        return self.llm.warm_up()

    def shutdown(self) -> None:
        """Abort open requests and stop the thread; an LLM this AsyncLLM created is shut down too (follower
        ranks released), one passed in stays usable."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._owns_llm:
            self.llm.shutdown()

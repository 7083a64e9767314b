"""The Python API: `LLM` (offline, blocking) and `AsyncLLM` (a background thread runs the scheduler;
asyncio-facing streams), over a built engine directory.

Both render chats with the engine's tokenizer family, apply the thinking budget of the request's effort
(`ReasoningBudget`: forced close markers, `reasoning_tokens` in usage), parse the output into reasoning,
content and tool calls, and keep finished turns' state for reuse by the next turn (exact token prefix).
Under mpiexec, rank 0 holds the API and other ranks call `run_follower()`; with a dp-layout engine rank 0 spreads
the requests over the attention groups (`runtime.core.wide_ep`) and returns the outputs in prompt order as usual.
Requests run through `llm_core.RequestCore` (the scheduler and each request's output stage).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from moe_export.common.errors import EngineDead, InputError, RequestFailed
from moe_export.common.model_config import read_generation_config
from moe_export.runtime.chat import (
    OutputParser,
    generation_prompt_ids,
    output_starts_in_reasoning,
    render_ids,
)
from moe_export.runtime.core.budget import ReasoningBudget, resolve_thinking
from moe_export.runtime.core.contracts import BudgetSpec
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.core.wide_ep import run_rank
from moe_export.runtime.engine import engine_eos_ids
from moe_export.runtime.entrypoints.llm_core import ChatOutput, RequestCore, StreamDelta, Tracked
from moe_export.runtime.image_urls import private_allowed, public_address
from moe_export.runtime.images import PromptImages
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams, model_defaults
from moe_export.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from moe_export.runtime.core.structured import GrammarVocab


GenerationOutput = ChatOutput


class LLM:
    """A built engine with its tokenizer and chat family; offline batch API (the vLLM shape).

    default_effort: thinking tier when a chat request gives none (low | high | max | none).
    reuse_sessions: keep finished turns' state for reuse by a continuing prompt, and their tokens, so that a
    turn sent back as text is rendered as generated and the prompt continues the kept state (default on).
    prefix_caching: share cached prompt prefixes across requests (`runtime.core.prefix_cache`; default on).
    overlap: run each model step in a worker thread while the host plans the next step and processes the
    previous step's outputs (`EngineCore(overlap=True)`, see `runtime.core.scheduler`; default on, also under
    mpiexec; not in the dp layout; greedy outputs are the same either way).
    skip_tokenizer_init: open no tokenizer (vLLM's name; for an engine built without tokenizer files): prompts are
    token id lists, outputs carry ids and no text, the stop ids are the engine's; chats and stop strings need one.
    allow_image_urls: image parts may be http(s) URLs, fetched with a size and time limit from public addresses
    (`runtime.image_urls`; default: data URLs only); allow_private_image_urls: from any address but cloud metadata.

    Failures: a request the engine fails raises `RequestFailed` (the others go on); once the engine core is dead
    (`healthy` False, `fatal_error` the `EngineDead`) every call raises that EngineDead."""

    def __init__(self, engine_dir: str | Path, *, default_effort: str = "max", num_slots: int | None = None,
                 num_blocks: int | None = None, threads: int | None = None, reuse_sessions: bool = True,
                 prefix_caching: bool = True, allow_image_urls: bool = False, allow_private_image_urls: bool = False,
                 overlap: bool = True, runner=None, skip_tokenizer_init: bool = False) -> None:
        from moe_export.runtime.engine import open_engine

        # runner: a ModelRunner to drive instead of the engine directory's own (which then provides the tokenizer)
        self.engine = runner or open_engine(engine_dir, num_slots=num_slots, num_blocks=num_blocks, threads=threads)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(engine_dir)
        self.family = self.tokenizer.family if self.tokenizer is not None else None
        self.thinking_caps: dict[str, int] = self.engine.config.thinking if self.engine.config is not None else {}
        resolve_thinking(None, self.thinking_caps, default_effort)  # validates the default tier
        self.default_effort = default_effort
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.eos_token_ids = sorted(set(tokenizer_eos) | set(engine_eos_ids(self.engine)))
        self.reuse_sessions = reuse_sessions
        self.prefix_caching = prefix_caching
        self.overlap = overlap
        # the addresses http(s) image parts may be fetched from (`runtime.image_urls`); None: URLs refused
        self.image_url_policy = None if not allow_image_urls else private_allowed if allow_private_image_urls else public_address
        # finished turns' tokens, as many as the cache pools hold, so turns sent back as text render as generated
        self.turns = TurnMemory(self.engine.num_blocks * self.engine.block_size) if reuse_sessions else None
        self._turn_start = {thinking: len(generation_prompt_ids(self.tokenizer, self.family, thinking))
                            for thinking in (True, False)} if self.family else {}
        self._ids = itertools.count()
        model = self.engine.model_config
        self.vocab_size = int(model.get("vocab_size") or (model.get("text_config") or {}).get("vocab_size") or self.tokenizer.vocab_size)
        self._grammar_vocab: GrammarVocab | None = None
        # the one set of sampling defaults (requests without their own parameters use it)
        self.default_sampling = model_defaults(read_generation_config(engine_dir))
        self._core = (RequestCore(self.engine, self.tokenizer, self.turns, **self.scheduler_kwargs())
                      if self.engine.is_root else None)

    # ---- request preparation (rank 0) -----------------------------------------------------------

    def _new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"req-{next(self._ids)}"

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this LLM has no tokenizer (skip_tokenizer_init): give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InputError("the prompt encodes to no tokens")
            return ids
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise InputError("a prompt is a string or a list of token ids")
        return list(prompt)

    def prepare_generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                         request_id: str | None = None) -> Tracked:
        return Tracked(self._new_id(request_id), self._prompt_ids(prompt), sampling or self.default_sampling, None, None)

    def render_chat(self, messages: list[dict], *, tools=None, reasoning_effort=None, tool_choice=None,
                    response_format=None, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation as a chat request renders it: an assistant message that is a turn
        this LLM generated (or that carries `turn_ids`) is rendered as the turn's tokens (`chat.render_ids`)."""
        plan = resolve_thinking(reasoning_effort, self.thinking_caps, self.default_effort)
        return self._render(messages, plan, tools, tool_choice, response_format, add_generation_prompt)

    def _render(self, messages: list[dict], plan, tools, tool_choice, response_format, add_generation_prompt=True,
                images=None) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this LLM has no tokenizer (skip_tokenizer_init): chats need one; use generate() with "
                             "token ids")
        if self.family is None:
            raise InputError(f"{self.engine.dir}: the tokenizer has no K3 or K2 chat tokens: use generate()")
        vision = self.engine.vision
        if vision is not None and images is None:  # image parts become their media tokens (`runtime.images`)
            images = PromptImages(self.tokenizer, vision.processor, messages, vision.max_images, self.image_url_policy,
                                  vision.cached)
        carried = []
        if self.turns is not None and isinstance(messages, list):
            carried = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant" and m.get("turn_ids") is not None]
            messages = [self._recalled(m) for m in messages]
        ids = render_ids(self.tokenizer, messages, family=self.family, tools=tools, thinking=plan.enabled,
                         thinking_effort=plan.tier, tool_choice=tool_choice, response_format=response_format,
                         add_generation_prompt=add_generation_prompt, vision=vision is not None, images=images)
        for m in carried:  # e.g. a stored Responses chain: the same turn sent back as text renders the same way
            self.turns.remember(m, m["turn_ids"])
        return ids

    def _recalled(self, message):
        """`message` with the turn_ids remembered for it, if it is an assistant message without any."""
        if not isinstance(message, dict) or message.get("role") != "assistant" or message.get("turn_ids") is not None:
            return message
        ids = self.turns.recall(message)
        return message if ids is None else {**message, "turn_ids": ids}

    def prepare_chat(self, messages: list[dict], sampling: SamplingParams | None = None, *, tools=None,
                     reasoning_effort=None, tool_choice=None, response_format=None, parallel_tool_calls: bool = True,
                     request_id: str | None = None) -> Tracked:
        """Render a conversation and set up its budget, output parser and grammar: a forced or required tool
        call (`tool_choice`) or a JSON `response_format` is enforced by grammar-constrained decoding, the same
        way for every entry point (LLM.chat, AsyncLLM, the server, Triton, batch)."""
        plan = resolve_thinking(reasoning_effort, self.thinking_caps, self.default_effort)
        vision = self.engine.vision
        images = (PromptImages(self.tokenizer, vision.processor, messages, vision.max_images, self.image_url_policy,
                               vision.cached) if vision else None)
        ids = self._render(messages, plan, tools, tool_choice, response_format, images=images)
        starts = output_starts_in_reasoning(self.family, plan.enabled)
        budget = ReasoningBudget(self.tokenizer, self.family, plan.cap if plan.enabled else None, starts_in_reasoning=starts)
        parser = OutputParser(self.tokenizer, self.family, starts_in_reasoning=starts, tools_declared=bool(tools))
        tracked = Tracked(self._new_id(request_id), ids, sampling or self.default_sampling, parser, budget,
                           self._turn_start[plan.enabled], images=images.order if images else [], thinking_tier=plan.tier)
        if tools or response_format is not None:  # only these may need a grammar
            self._constrain(tracked, tools, tool_choice, response_format, plan.enabled, starts, parallel_tool_calls)
        return tracked

    def _constrain(self, tracked: Tracked, tools, tool_choice, response_format, thinking: bool, starts: bool,
                   parallel_tool_calls: bool) -> None:
        """Attach the grammar a request's tools or response_format enforce, if any (xgrammar, which pulls in
        transformers, is imported here: requests without either never load it)."""
        from moe_export.runtime.core.structured import (
            GrammarLogitsProcessor,
            GrammarVocab,
            structural_tag_for,
        )

        tag = structural_tag_for(self.family, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                 thinking=thinking, starts_in_reasoning=starts, parallel_tool_calls=parallel_tool_calls)
        if tag is not None:
            if self._grammar_vocab is None:  # built on the first constrained request
                self._grammar_vocab = GrammarVocab(self.tokenizer, self.family, self.vocab_size)
            tracked.grammar = GrammarLogitsProcessor(self._grammar_vocab, self._grammar_vocab.compile(tag))

    # ---- blocking API ---------------------------------------------------------------------------

    @property
    def fatal_error(self) -> BaseException | None:
        """What killed the engine core (an `EngineDead`), or None while it serves (always None on follower ranks)."""
        return self._core.fatal_error if self._core is not None else None

    @property
    def healthy(self) -> bool:
        """Whether the engine core can serve requests (False once it is dead)."""
        return self.fatal_error is None

    def _root(self) -> RequestCore:
        if self._core is None:
            raise InputError("this is a follower rank under mpiexec: call run_follower(); rank 0 serves requests")
        return self._core

    def _run(self, tracked: list[Tracked], processors: list[LogitsProcessor] | None = None) -> Iterator[StreamDelta]:
        core = self._root()
        pending: set[str] = set()
        try:
            for tr in tracked:
                core.submit(tr, processors)
                pending.add(tr.request_id)
            while pending:
                for delta in core.step():
                    if delta.request_id in pending:
                        if delta.error:
                            pending.discard(delta.request_id)
                            raise RequestFailed(delta.error)
                        if delta.finished:
                            pending.discard(delta.request_id)
                        yield delta
        finally:  # an error, or a consumer that stopped iterating: the rest must not hold slots and blocks
            if core.fatal_error is None:
                for rid in pending:
                    core.abort(rid)
                    core.tracked.pop(rid, None)
                while pending and core.has_work:  # drain the abort notices and any step still in flight
                    core.step()

    def _collect(self, tracked: list[Tracked], processors=None) -> list[ChatOutput]:
        done = {d.request_id: d.output for d in self._run(tracked, processors) if d.finished}
        return [done[tr.request_id] for tr in tracked]

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams | None = None, *,
                 logits_processors: list[LogitsProcessor] | None = None) -> list[GenerationOutput]:
        """Continue each prompt (text or token ids), all batched together; outputs in prompt order."""
        return self._collect([self.prepare_generate(p, sampling) for p in prompts], logits_processors)

    def chat(self, conversations: list[list[dict]], sampling: SamplingParams | None = None, *, tools=None,
             reasoning_effort=None, tool_choice=None, response_format=None, parallel_tool_calls: bool = True,
             logits_processors: list[LogitsProcessor] | None = None) -> list[ChatOutput]:
        """Answer each conversation (OpenAI message dicts), all batched together."""
        tracked = [self.prepare_chat(c, sampling, tools=tools, reasoning_effort=reasoning_effort, tool_choice=tool_choice,
                                     response_format=response_format, parallel_tool_calls=parallel_tool_calls)
                   for c in conversations]
        return self._collect(tracked, logits_processors)

    def chat_stream(self, messages: list[dict], sampling: SamplingParams | None = None, **kwargs) -> Iterator[StreamDelta]:
        """One conversation's deltas as they are generated (blocking iterator; the terminal uses it)."""
        processors = kwargs.pop("logits_processors", None)
        return self._run([self.prepare_chat(messages, sampling, **kwargs)], processors)

    def stats(self) -> dict:
        return self._root().stats()

    def scheduler_kwargs(self) -> dict:
        """How this LLM's schedulers are set up (rank 0's, and in the dp layout every group leader's)."""
        tok = self.tokenizer
        return {"eos_token_ids": self.eos_token_ids, "text_decoder": tok.incremental_decoder if tok is not None else None,
                "keep_sessions": self.reuse_sessions, "prefix_caching": self.prefix_caching,
                "sample_vocab": tok.vocab_size if tok is not None else None, "overlap": self.overlap}

    def _budget(self, spec: BudgetSpec) -> ReasoningBudget:
        return ReasoningBudget(self.tokenizer, spec.family, spec.cap, starts_in_reasoning=spec.starts_in_reasoning)

    def run_follower(self) -> None:
        """Non-root ranks under mpiexec: execute rank 0's steps until it shuts down (dp layout: a group's first
        rank schedules the requests rank 0 sends its group, the others follow it; `runtime.core.wide_ep`)."""
        if self.engine.is_root:
            raise InputError("run_follower() is for non-root ranks; rank 0 serves requests")
        run_rank(self.engine, budget_factory=self._budget, **self.scheduler_kwargs())

    def shutdown(self) -> None:
        """Rank 0: release the follower ranks (multi-rank); the LLM takes no requests afterwards."""
        if self._core is not None:
            self._core.shutdown()
            self._core = None


class AsyncLLM:
    """asyncio front end: one background thread owns the scheduler and steps while there is work;
    requests and aborts reach it through a command list, deltas come back on per-request queues.

    A request the engine fails ends its stream with `RequestFailed`; the others go on. When the engine core dies
    (`healthy` False, `fatal_error` its `EngineDead`), every open stream and every later request end with that
    EngineDead (a server answers /health with 503 and exits non-zero)."""

    def __init__(self, engine_dir_or_llm: str | Path | LLM, **kwargs) -> None:
        self._owns_llm = not isinstance(engine_dir_or_llm, LLM)
        self.llm = LLM(engine_dir_or_llm, **kwargs) if self._owns_llm else engine_dir_or_llm
        self.tokenizer, self.family = self.llm.tokenizer, self.llm.family
        self.default_sampling = self.llm.default_sampling  # the engine's one set of sampling defaults
        self._core = self.llm._root()
        self._cv = threading.Condition()
        self._commands: list = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closing = False
        self._core.on_dead.append(self._end_streams)  # a rank's fault (the scheduler thread may wait in a collective)
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

    async def _stream(self, tracked: Tracked, processors) -> AsyncIterator[StreamDelta]:
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
        tracked = self.llm.prepare_chat(messages, sampling, tools=tools, reasoning_effort=reasoning_effort,
                                        tool_choice=tool_choice, response_format=response_format,
                                        parallel_tool_calls=parallel_tool_calls, request_id=request_id)
        return self._stream(tracked, logits_processors)

    def render_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """`LLM.render_chat`: the prompt ids a chat request would run."""
        return self.llm.render_chat(messages, **kwargs)

    def generate_stream(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                        request_id: str | None = None, logits_processors: list[LogitsProcessor] | None = None
                        ) -> AsyncIterator[StreamDelta]:
        """Stream one prompt's continuation."""
        return self._stream(self.llm.prepare_generate(prompt, sampling, request_id), logits_processors)

    async def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kwargs) -> ChatOutput:
        async for delta in self.chat_stream(messages, sampling, **kwargs):
            if delta.finished:
                return delta.output
        raise RuntimeError("the stream ended without a final delta")

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, **kwargs) -> ChatOutput:
        async for delta in self.generate_stream(prompt, sampling, **kwargs):
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

    def shutdown(self) -> None:
        """Abort open requests and stop the thread; an LLM this AsyncLLM created is shut down too (follower
        ranks released), one passed in stays usable."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._owns_llm:
            self.llm.shutdown()

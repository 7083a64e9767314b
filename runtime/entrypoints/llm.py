"""The Python API: `LLM` (offline, blocking) and `AsyncLLM` (a background thread runs the scheduler;
asyncio-facing streams), over a built engine directory.

Both render chats with the engine's tokenizer family, apply the thinking budget of the request's effort
(`ReasoningBudget`: forced close markers, `reasoning_tokens` in usage), parse the output into reasoning,
content and tool calls, and keep finished turns' state for reuse by the next turn (exact token prefix).
Under mpiexec, rank 0 holds the API and other ranks call `run_follower()`; with a dp-layout engine rank 0 spreads
the requests over the attention groups (`runtime.core.wide_ep`) and returns the outputs in prompt order as usual.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moe_export.common.errors import InputError, InternalError
from moe_export.common.model_config import read_generation_config
from moe_export.runtime.chat import (
    OutputParser,
    ParsedDelta,
    ParsedMessage,
    generation_prompt_ids,
    output_starts_in_reasoning,
    render_ids,
)
from moe_export.runtime.core.budget import ReasoningBudget, resolve_thinking
from moe_export.runtime.core.scheduler import Request, SequenceUpdate
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.core.wide_ep import open_scheduler, run_rank
from moe_export.runtime.entrypoints.generate import engine_eos_ids
from moe_export.runtime.images import PromptImages
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams, model_defaults
from moe_export.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from moe_export.runtime.core.structured import GrammarLogitsProcessor, GrammarVocab


@dataclass
class ChatOutput:
    """A finished request. text: the raw decoded output (a final stop token left out, cut before a stop
    string); reasoning_content / content / tool_calls: the parsed message (chat requests; for plain
    generation content is the text). usage: prompt_tokens, completion_tokens, reasoning_tokens,
    cached_tokens (prompt tokens whose state came from a kept session). turn_ids (chats): the assistant
    turn's tokens, generation prompt and output, which `message()` carries into the next turn. stop_string:
    the request's stop string the output ended at, if it did."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    usage: dict
    logprobs: list[float] | None
    tool_call_parse_failures: int = 0
    turn_ids: list[int] | None = None
    stop_string: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, when logprobs were asked
    grammar_completed: bool | None = None  # a forced tool call / JSON format: the output is a whole sentence of it

    def message(self) -> dict:
        """The assistant message for the conversation's history (rendered as `turn_ids` next turn)."""
        msg: dict = {"role": "assistant", "content": self.content or "", "reasoning_content": self.reasoning_content or ""}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.turn_ids is not None:
            msg["turn_ids"] = self.turn_ids
        return msg


GenerationOutput = ChatOutput


@dataclass
class StreamDelta:
    """New output of one step: token ids (with their logprobs and most likely alternatives when asked), raw text
    delta and, for chats, parsed reasoning / content deltas."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    reasoning: str = ""
    content: str = ""
    finished: bool = False
    output: ChatOutput | None = None
    error: str | None = None  # set (with finished) when the runtime ended the request, e.g. a failing logits processor
    thinking_tier: str | None = None  # chats: the tier the core resolved the request's effort to ("none": off)
    logprobs: list[float] | None = None  # per token id, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None


class _OutputText:
    """One request's output stage: the scheduler's decoded text (`SequenceUpdate.text`: detokenized once, where
    the stop strings are checked) streamed and parsed step by step, each step costing O(its new tokens).

    The raw text (special tokens by name) is streamed with a suffix that may begin one of the stop
    strings held back. The chat parser is fed only tokens whose text has been streamed, so its reasoning /
    content deltas never show a stop string or what follows it; when the output ends at a stop string, the
    part of the token it begins in that precedes it reaches the parser as text."""

    def __init__(self, tokenizer, stops: tuple[str, ...], parser: OutputParser | None) -> None:
        self.tok, self.stops, self.parser = tokenizer, stops, parser
        self.pieces: list[str] = []
        self.length = 0  # characters decoded so far
        self.held = ""  # decoded text not streamed yet
        self.sent = 0  # characters streamed
        self.unparsed: deque[tuple[list[int], int]] = deque()  # (ids, end offset) of whole characters, not parsed yet
        self.partial: list[int] = []  # ids of a character not complete yet
        self.parsed_to = 0  # end offset of the text the parser has been fed

    def step(self, ids: list[int], piece: str, *, complete: bool, finished: bool, stop_token: bool,
             stop_index: int | None) -> tuple[str, ParsedDelta]:
        """New text and parsed delta of `ids`, whose decoded text is `piece` (complete: it ends on a whole
        character; stop_token: the last id is a stop token, not text; stop_index: where the stop string the
        output ended at starts in the text)."""
        self.pieces.append(piece)
        self.length += len(piece)
        self.held += piece
        self.partial += ids[:-1] if stop_token else ids
        if self.partial and (complete or finished):
            self.unparsed.append((self.partial, self.length))
            self.partial = []
        if finished:
            end = self.length if stop_index is None else stop_index
        else:
            end = self.length - self._stop_prefix_len()
        cut = max(end - self.sent, 0)
        text, self.held = self.held[:cut], self.held[cut:]
        self.sent += cut
        return text, self._parse(ids, finished, stop_token, stop_index)

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the held text that begins a stop string (held back from streaming):
        for each stop, only the positions in its reach where its first character occurs are tried."""
        held, best = self.held, 0
        for s in self.stops:
            i = held.find(s[0], max(len(held) - len(s) + 1, 0))
            while i != -1:
                if s.startswith(held[i:]):
                    best = max(best, len(held) - i)
                    break
                i = held.find(s[0], i + 1)
        return best

    def _parse(self, ids: list[int], finished: bool, stop_token: bool, stop_index: int | None) -> ParsedDelta:
        delta = ParsedDelta()
        if self.parser is None:
            return delta

        def add(d: ParsedDelta) -> None:
            delta.reasoning += d.reasoning
            delta.content += d.content

        while self.unparsed and self.unparsed[0][1] <= self.sent:
            group, self.parsed_to = self.unparsed.popleft()
            add(self.parser.feed(group))
        if finished:
            cut = self.unparsed[0][0] if stop_index is not None and self.unparsed and self.parsed_to < stop_index else []
            if cut and not any(self.tok.is_special(t) for t in cut):
                add(self.parser.feed_text(self.text()[self.parsed_to: stop_index]))
            if stop_token:
                add(self.parser.feed(ids[-1:]))
        return delta

    def text(self) -> str:
        """All text decoded so far (joined once, at the end)."""
        return "".join(self.pieces)


@dataclass
class _Tracked:
    """Rank 0's output-side state of one request. turn_start: prompt tokens that open the assistant turn
    (the generation prompt; chats)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    parser: OutputParser | None
    budget: ReasoningBudget | None
    turn_start: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0
    out: _OutputText | None = None
    images: list = field(default_factory=list)  # runtime.images.PreparedImage of the prompt's images, in order
    grammar: GrammarLogitsProcessor | None = None  # tool_choice / response_format enforced, whatever the entry point
    thinking_tier: str | None = None  # chats: the resolved thinking tier (resolved once, in `prepare_chat`)


class _Core:
    """Scheduler + per-request detokenizing, parsing and budgets: one step -> StreamDeltas. One thread."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.sched = open_scheduler(llm.engine, **llm.scheduler_kwargs())
        self.tracked: dict[str, _Tracked] = {}

    def submit(self, tracked: _Tracked, processors: list[LogitsProcessor] | None) -> None:
        processors = list(processors or ()) + ([tracked.grammar] if tracked.grammar is not None else [])
        self.sched.add(Request(tracked.request_id, tracked.prompt_ids, tracked.sampling, processors, tracked.budget,
                               tracked.images))
        tracked.out = _OutputText(self.llm.tokenizer, tracked.sampling.stop, tracked.parser)
        self.tracked[tracked.request_id] = tracked

    def step(self) -> list[StreamDelta]:
        return [self._delta(u) for u in self.sched.step()]

    def _delta(self, u: SequenceUpdate) -> StreamDelta:
        tr = self.tracked[u.request_id]
        tr.output_ids += u.token_ids
        tr.logprobs += u.logprobs or []
        tr.top_logprobs += u.top_logprobs or []
        tr.cached_tokens = max(tr.cached_tokens, u.cached_tokens)
        stop_token = u.finished and u.finish_reason == "stop" and bool(u.token_ids) and u.stop_text_index is None
        text, parsed = tr.out.step(u.token_ids, u.text, complete=u.text_complete, finished=u.finished,
                                   stop_token=stop_token, stop_index=u.stop_text_index)
        delta = StreamDelta(u.request_id, list(u.token_ids), text, parsed.reasoning, parsed.content,
                            thinking_tier=tr.thinking_tier)
        if tr.sampling.logprobs:
            delta.logprobs, delta.top_logprobs = list(u.logprobs or []), list(u.top_logprobs or [])
        if tr.parser is None:
            delta.content = text
        if u.finished:
            del self.tracked[u.request_id]
            delta.finished = True
            delta.output = self._output(tr, u)
            if tr.parser is not None:  # what finish() released: a held character, an unfinished tool call
                delta.reasoning += tr.parser.delta.reasoning
                delta.content += tr.parser.delta.content
            delta.error = u.error and f"request {tr.request_id}: {u.error}"
        return delta

    def _output(self, tr: _Tracked, u: SequenceUpdate) -> ChatOutput:
        whole = tr.out.text()
        text = whole[: u.stop_text_index]
        stop_string = None
        if u.stop_text_index is not None:
            stop_string = next((s for s in tr.sampling.stop if whole.startswith(s, u.stop_text_index)), None)
        msg = tr.parser.finish() if tr.parser is not None else ParsedMessage(None, text or None)
        reason = u.finish_reason
        if reason == "stop" and msg.tool_calls:
            reason = "tool_calls"
        usage = {
            "prompt_tokens": len(tr.prompt_ids),
            "completion_tokens": len(tr.output_ids),
            "reasoning_tokens": tr.budget.reasoning_tokens if tr.budget is not None else 0,
            "cached_tokens": tr.cached_tokens,
        }
        turn_ids = tr.prompt_ids[len(tr.prompt_ids) - tr.turn_start:] + tr.output_ids if tr.parser is not None else None
        out = ChatOutput(tr.request_id, tr.prompt_ids, tr.output_ids, text, msg.reasoning_content, msg.content,
                         msg.tool_calls, reason, usage, tr.logprobs if tr.sampling.logprobs else None,
                         msg.tool_call_parse_failures, turn_ids, stop_string,
                         tr.top_logprobs if tr.sampling.logprobs else None,
                         None if tr.grammar is None else tr.grammar.completed)
        if turn_ids is not None and self.llm.turns is not None and reason != "abort":
            self.llm.turns.remember(out.message(), turn_ids)
        return out


class LLM:
    """A built engine with its tokenizer and chat family; offline batch API (the vLLM shape).

    default_effort: thinking tier when a chat request gives none (low | high | max | none).
    reuse_sessions: keep finished turns' state for reuse by a continuing prompt, and their tokens, so that a
    turn sent back as text is rendered as generated and the prompt continues the kept state (default on).
    prefix_caching: share cached prompt prefixes across requests (`runtime.core.prefix_cache`; default on).
    overlap: run each model step in a worker thread while the host plans the next step and processes the
    previous step's outputs (`Scheduler(overlap=True)`, see `runtime.core.scheduler`; default on, also under
    mpiexec; not in the dp layout; greedy outputs are the same either way).
    allow_image_urls: image parts may be http(s) URLs, fetched with a size and time limit (default: data URLs only)."""

    def __init__(self, engine_dir: str | Path, *, default_effort: str = "max", num_slots: int | None = None,
                 num_blocks: int | None = None, threads: int | None = None, reuse_sessions: bool = True,
                 prefix_caching: bool = True, allow_image_urls: bool = False, overlap: bool = True, runner=None) -> None:
        from moe_export.runtime.engine import open_engine

        # runner: a ModelRunner to drive instead of the engine directory's own (which then provides the tokenizer)
        self.engine = runner or open_engine(engine_dir, num_slots=num_slots, num_blocks=num_blocks, threads=threads)
        self.tokenizer = load_tokenizer(engine_dir)
        self.family = self.tokenizer.family
        self.thinking_caps: dict[str, int] = self.engine.config.thinking if self.engine.config is not None else {}
        resolve_thinking(None, self.thinking_caps, default_effort)  # validates the default tier
        self.default_effort = default_effort
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(engine_eos_ids(self.engine)))
        self.reuse_sessions = reuse_sessions
        self.prefix_caching = prefix_caching
        self.overlap = overlap
        self.allow_image_urls = allow_image_urls  # fetch http(s) image parts (`runtime.images.fetch_image_url`)
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
        self._core = _Core(self) if self.engine.is_root else None

    # ---- request preparation (rank 0) -----------------------------------------------------------

    def _new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"req-{next(self._ids)}"

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InputError("the prompt encodes to no tokens")
            return ids
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise InputError("a prompt is a string or a list of token ids")
        return list(prompt)

    def prepare_generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                         request_id: str | None = None) -> _Tracked:
        return _Tracked(self._new_id(request_id), self._prompt_ids(prompt), sampling or self.default_sampling, None, None)

    def render_chat(self, messages: list[dict], *, tools=None, reasoning_effort=None, tool_choice=None,
                    response_format=None, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation as a chat request renders it: an assistant message that is a turn
        this LLM generated (or that carries `turn_ids`) is rendered as the turn's tokens (`chat.render_ids`)."""
        plan = resolve_thinking(reasoning_effort, self.thinking_caps, self.default_effort)
        return self._render(messages, plan, tools, tool_choice, response_format, add_generation_prompt)

    def _render(self, messages: list[dict], plan, tools, tool_choice, response_format, add_generation_prompt=True,
                images=None) -> list[int]:
        if self.family is None:
            raise InputError(f"{self.engine.dir}: the tokenizer has no K3 or K2 chat tokens: use generate()")
        vision = getattr(self.engine, "vision", None)
        if vision is not None and images is None:  # image parts become their media tokens (`runtime.images`)
            images = PromptImages(self.tokenizer, vision.processor, messages, vision.max_images, self.allow_image_urls,
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
                     request_id: str | None = None) -> _Tracked:
        """Render a conversation and set up its budget, output parser and grammar: a forced or required tool
        call (`tool_choice`) or a JSON `response_format` is enforced by grammar-constrained decoding, the same
        way for every entry point (LLM.chat, AsyncLLM, the server, Triton, batch)."""
        plan = resolve_thinking(reasoning_effort, self.thinking_caps, self.default_effort)
        vision = getattr(self.engine, "vision", None)
        images = (PromptImages(self.tokenizer, vision.processor, messages, vision.max_images, self.allow_image_urls,
                               vision.cached) if vision else None)
        ids = self._render(messages, plan, tools, tool_choice, response_format, images=images)
        starts = output_starts_in_reasoning(self.family, plan.enabled)
        budget = ReasoningBudget(self.tokenizer, self.family, plan.cap if plan.enabled else None, starts_in_reasoning=starts)
        parser = OutputParser(self.tokenizer, self.family, starts_in_reasoning=starts, tools_declared=bool(tools))
        tracked = _Tracked(self._new_id(request_id), ids, sampling or self.default_sampling, parser, budget,
                           self._turn_start[plan.enabled], images=images.order if images else [], thinking_tier=plan.tier)
        if tools or response_format is not None:  # only these may need a grammar
            self._constrain(tracked, tools, tool_choice, response_format, plan.enabled, starts, parallel_tool_calls)
        return tracked

    def _constrain(self, tracked: _Tracked, tools, tool_choice, response_format, thinking: bool, starts: bool,
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

    def _root(self) -> _Core:
        if self._core is None:
            raise InputError("this is a follower rank under mpiexec: call run_follower(); rank 0 serves requests")
        return self._core

    def _run(self, tracked: list[_Tracked], processors: list[LogitsProcessor] | None = None) -> Iterator[StreamDelta]:
        core = self._root()
        for tr in tracked:
            core.submit(tr, processors)
        pending = {tr.request_id for tr in tracked}
        try:
            while pending:
                for delta in core.step():
                    if delta.request_id in pending:
                        if delta.error:
                            raise InputError(delta.error)
                        if delta.finished:
                            pending.discard(delta.request_id)
                        yield delta
        finally:  # an error, or a consumer that stopped iterating: the rest must not hold slots and blocks
            for rid in pending:
                core.sched.abort(rid)
            if pending:
                core.step()  # drains the abort notices (no engine step: nothing else is queued)

    def _collect(self, tracked: list[_Tracked], processors=None) -> list[ChatOutput]:
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
        return self._root().sched.stats()

    def scheduler_kwargs(self) -> dict:
        """How this LLM's schedulers are set up (rank 0's, and in the dp layout every group leader's)."""
        return {"eos_token_ids": self.eos_token_ids, "text_decoder": self.tokenizer.incremental_decoder,
                "keep_sessions": self.reuse_sessions, "prefix_caching": self.prefix_caching,
                "sample_vocab": self.tokenizer.vocab_size, "overlap": self.overlap}

    def _budget(self, spec: tuple) -> ReasoningBudget:
        family, cap, starts = spec
        return ReasoningBudget(self.tokenizer, family, cap, starts_in_reasoning=starts)

    def run_follower(self) -> None:
        """Non-root ranks under mpiexec: execute rank 0's steps until it shuts down (dp layout: a group's first
        rank schedules the requests rank 0 sends its group, the others follow it; `runtime.core.wide_ep`)."""
        if self.engine.is_root:
            raise InputError("run_follower() is for non-root ranks; rank 0 serves requests")
        run_rank(self.engine, budget_factory=self._budget, **self.scheduler_kwargs())

    def shutdown(self) -> None:
        """Rank 0: release the follower ranks (multi-rank); the LLM takes no requests afterwards."""
        if self._core is not None:
            self._core.sched.shutdown()
            self._core = None


class AsyncLLM:
    """asyncio front end: one background thread owns the scheduler and steps while there is work;
    requests and aborts reach it through a command list, deltas come back on per-request queues."""

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
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="moe-export-scheduler", daemon=True)
        self._thread.start()

    # ---- scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._core.sched.has_work and not self._closing:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                if self._closing and not commands:
                    for rid in list(self._queues):
                        self._core.sched.abort(rid)
            for command in commands:
                command()
            try:
                deltas = self._core.step() if self._core.sched.has_work else []
            except BaseException as exc:  # the engine failed: every open stream ends with an internal error
                failure = exc if isinstance(exc, InternalError) else InternalError(f"the engine failed: {type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                self._failure = failure
                for rid in list(self._queues):
                    self._push(rid, failure)
                return
            for d in deltas:
                self._push(d.request_id, d)
            if self._closing and not self._core.sched.has_work and not self._commands:
                return

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
            if self._failure is not None:
                raise self._failure
            if self._closing:
                raise InputError("the engine is shut down")
            self._commands.append(fn)
            self._cv.notify()

    # ---- asyncio API ----------------------------------------------------------------------------

    async def _stream(self, tracked: _Tracked, processors) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = tracked.request_id
        if rid in self._queues:
            raise InputError(f"request id {rid!r} is already in use")
        self._queues[rid] = (loop, queue)

        def submit() -> None:
            try:
                self._core.submit(tracked, processors)
            except InputError as exc:
                self._push(rid, exc)

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
                    raise InputError(item.error)
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
            if self._closing or self._failure is not None:
                return
            self._commands.append(lambda: self._core.sched.abort(request_id))
            self._cv.notify()

    def stats(self) -> dict:
        return self._core.sched.stats()

    def shutdown(self) -> None:
        """Abort open requests and stop the thread; an LLM this AsyncLLM created is shut down too (follower
        ranks released), one passed in stays usable."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._owns_llm:
            self.llm.shutdown()

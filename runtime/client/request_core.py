"""Rank 0's request core behind `LLM` and `AsyncLLM`: the engine core plus each request's output stage (its text
streamed and parsed step by step), turning one scheduler step into `StreamDelta`s and finished `ChatOutput`s.

A failure confined to one request (its output stage raising, or the scheduler ending it) becomes that request's
final delta with `error` set; any exception out of the scheduler's step kills the core (`fatal_error`, an
`EngineDead`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_export.common.errors import EngineDead, InputError
from moe_export.runtime.chat import OutputParser, ParsedDelta, ParsedMessage, ToolCallDelta
from moe_export.runtime.core.budget import ReasoningBudget
from moe_export.runtime.core.contracts import Request, SequenceUpdate
from moe_export.runtime.core.execution import WORLD_BROKEN, FaultWatch
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.core.wide_ep import open_engine_core
from moe_export.runtime.engine.runner import ModelRunner
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams

if TYPE_CHECKING:
    from moe_export.runtime.core.structured import GrammarLogitsProcessor


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


@dataclass
class StreamDelta:
    """New output of one step: token ids (with their logprobs and most likely alternatives when asked), raw text
    delta and, for chats, parsed reasoning / content deltas and `parts`: the step's reasoning / content text and
    tool-call pieces in output order (`ParsedDelta.parts`; what the server streams)."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    reasoning: str = ""
    content: str = ""
    parts: list[tuple[str, str | ToolCallDelta]] = field(default_factory=list)
    finished: bool = False
    output: ChatOutput | None = None
    error: str | None = None  # set (with finished) when the engine failed the request (`RequestFailed`)
    thinking_tier: str | None = None  # chats: the tier the core resolved the request's effort to ("none": off)
    logprobs: list[float] | None = None  # per token id, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None


class OutputText:
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
        while self.unparsed and self.unparsed[0][1] <= self.sent:
            group, self.parsed_to = self.unparsed.popleft()
            delta.add(self.parser.feed(group))
        if finished:
            cut = self.unparsed[0][0] if stop_index is not None and self.unparsed and self.parsed_to < stop_index else []
            if cut and not any(self.tok.is_special(t) for t in cut):
                delta.add(self.parser.feed_text(self.text()[self.parsed_to: stop_index]))
            if stop_token:
                delta.add(self.parser.feed(ids[-1:]))
        return delta

    def text(self) -> str:
        """All text decoded so far (joined once, at the end)."""
        return "".join(self.pieces)


@dataclass
class Tracked:
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
    out: OutputText | None = None
    images: list = field(default_factory=list)  # runtime.images.PreparedImage of the prompt's images, in order
    grammar: GrammarLogitsProcessor | None = None  # tool_choice / response_format enforced, whatever the entry point
    thinking_tier: str | None = None  # chats: the resolved thinking tier (resolved once, by `InputProcessor.render`)
    turn_points: tuple[int, ...] = ()  # chats: `Request.turn_points`
    session: str | None = None  # the session the request names: `Request.session`
    # chats with a message after the conversation (K3's tool choice): this turn's message -> the ids the next turn's
    # prompt begins with (`InputProcessor.next_turn_prompt`), prefilled ahead as a warm turn
    next_turn: Callable[[dict], list[int]] | None = None


class RequestCore:
    """Engine core + per-request detokenizing, parsing and budgets: one step -> StreamDeltas. One thread.

    A failure confined to one request (its output stage raising here, or the scheduler ending it) becomes a final
    delta with `error` set; any exception out of the scheduler's step kills the core: `fatal_error` is then an
    `EngineDead`, raised by every later call, and follower ranks are released.

    warm_turns: when a chat whose next prompt departs from its own (`Tracked.next_turn`) finishes, the start of that
    next prompt (the conversation and this turn) is prefilled in the background (`Scheduler.add_warm`), so the next
    turn resumes after the model's own output (in the dp layout in the group that ran the turn, `GroupedScheduler.add_warm`)."""

    def __init__(self, engine: ModelRunner, tokenizer, turns: TurnMemory | None, *, warm_turns: bool = False,
                 **core_kwargs) -> None:
        self.engine, self.tokenizer, self.turns = engine, tokenizer, turns
        self.engine_core = open_engine_core(engine, **core_kwargs)
        self.warm_turns = warm_turns
        self.tracked: dict[str, Tracked] = {}
        self.fatal_error: EngineDead | None = None
        self.on_dead: list[Callable[[EngineDead], None]] = []  # called (any thread) when a rank's fault kills the core
        self._released = False
        # under mpiexec: a step failing on any rank ends the world through rank 0 (`core.execution`)
        self.watch = FaultWatch(engine.comm.world, self._world_fault) if engine.comm is not None else None

    def _world_fault(self, reason: str) -> None:
        """A rank's step failed (the FaultWatch thread; the world is aborted after this): the core is dead, its
        open requests end with the EngineDead, and every later call raises it."""
        if self.fatal_error is None:
            self.fatal_error = EngineDead(f"the engine stops: {reason}")
        for listener in self.on_dead:
            listener(self.fatal_error)

    def submit(self, tracked: Tracked, processors: list[LogitsProcessor] | None) -> None:
        if self.fatal_error is not None:
            raise self.fatal_error
        processors = list(processors or ()) + ([tracked.grammar] if tracked.grammar is not None else [])
        self.engine_core.add(Request(tracked.request_id, tracked.prompt_ids, tracked.sampling, processors, tracked.budget,
                               tracked.images, tracked.turn_points, tracked.session))
        tracked.out = OutputText(self.tokenizer, tracked.sampling.stop, tracked.parser)
        self.tracked[tracked.request_id] = tracked

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (its caller has gone; its final delta, if any, is dropped)."""
        self.tracked.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Abort a request in the engine core (its final update comes with a later step)."""
        return self.engine_core.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.engine_core.has_work

    def stats(self) -> dict:
        return self.engine_core.stats()

    def step(self) -> list[StreamDelta]:
        if self.fatal_error is not None:
            raise self.fatal_error
        try:
            updates = self.engine_core.step()
        except Exception as exc:  # (a KeyboardInterrupt stops the caller, not the core)
            raise self.die(exc) from exc
        deltas = []
        for u in updates:
            if u.request_id not in self.tracked:  # the abort notice of a request this stage failed
                continue
            try:
                deltas.append(self._delta(u))
            except Exception as exc:  # this request's detokenizing or parsing
                deltas.append(self._fail(u, exc))
        return deltas

    def _fail(self, u: SequenceUpdate, exc: Exception) -> StreamDelta:
        """End a request whose output stage raised (the scheduler frees its slot and blocks)."""
        tr = self.tracked.pop(u.request_id)
        if not u.finished:
            self.engine_core.abort(u.request_id)
        return StreamDelta(u.request_id, [], finished=True, thinking_tier=tr.thinking_tier,
                           error=f"request {u.request_id}: its output could not be processed: {type(exc).__name__}: {exc}")

    def die(self, exc: BaseException) -> EngineDead:
        """Mark the core dead because of `exc` (kept as the cause) and release follower ranks; the EngineDead."""
        if self.fatal_error is None:
            dead = exc if isinstance(exc, EngineDead) else EngineDead(
                f"the engine core failed and cannot go on: {type(exc).__name__}: {exc}")
            if dead is not exc:
                dead.__cause__ = exc
            self.fatal_error = dead
            self.tracked.clear()
            if self.engine.comm is not None and not WORLD_BROKEN.is_set():  # (a broken world is being aborted)
                self.shutdown()
        return self.fatal_error

    def shutdown(self) -> None:
        """Release follower ranks (once) and the step worker."""
        if not self._released:
            self._released = True
            if self.watch is not None:
                self.watch.stop()
            try:
                self.engine_core.shutdown()
            except Exception:
                if self.fatal_error is None:
                    raise

    def _delta(self, u: SequenceUpdate) -> StreamDelta:
        tr = self.tracked[u.request_id]
        tr.output_ids += u.token_ids
        tr.logprobs += u.logprobs or []
        tr.top_logprobs += u.top_logprobs or []
        tr.cached_tokens = max(tr.cached_tokens, u.cached_tokens)
        stop_token = u.finished and u.finish_reason == "stop" and bool(u.token_ids) and u.stop_text_index is None
        text, parsed = tr.out.step(u.token_ids, u.text, complete=u.text_complete, finished=u.finished,
                                   stop_token=stop_token, stop_index=u.stop_text_index)
        output = None
        if u.finished:
            del self.tracked[u.request_id]
            output = self._output(tr, u)
            if tr.parser is not None:  # what finish() released: a held character, the end of an unfinished tool call
                parsed.add(tr.parser.delta)
        if tr.parser is None:
            parsed.add_text("content", text)
        delta = StreamDelta(u.request_id, list(u.token_ids), text, parsed.reasoning, parsed.content, parsed.parts,
                            thinking_tier=tr.thinking_tier)
        if tr.sampling.logprobs:
            delta.logprobs, delta.top_logprobs = list(u.logprobs or []), list(u.top_logprobs or [])
        if u.finished:
            delta.finished, delta.output = True, output
            delta.error = u.error and f"request {tr.request_id} failed in the engine: {u.error}"
        return delta

    def _output(self, tr: Tracked, u: SequenceUpdate) -> ChatOutput:
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
        if turn_ids is not None and self.turns is not None and reason != "abort":
            self.turns.remember(out.message(), turn_ids)
            if self.warm_turns and tr.next_turn is not None:
                self._warm(tr, out)
        return out

    def _warm(self, tr: Tracked, out: ChatOutput) -> None:
        """Queue the warm turn of a finished chat: the start of its next prompt, prefilled ahead (none when this
        turn's message does not render)."""
        try:
            ids = tr.next_turn(out.message())
        except InputError:
            return
        self.engine_core.add_warm(Request(f"{tr.request_id}:warm", ids, SamplingParams(max_tokens=1)))

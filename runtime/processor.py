"""The one input processor: a request (a prompt, or messages with tools, response format, effort and images, plus
its sampling values) -> the engine request (`Tracked`) every front end submits: token ids rendered once, the
thinking plan resolved once, the reasoning budget, output parser and grammar set up.

A chat is processed in two parts, so that a request with n choices renders once: `render` (token ids, images,
thinking plan; CPU-bound: the server calls it in its request worker, off the event loop) and `chat_request` (per
choice: its sampling values, budget, parser, grammar). `chat` does both."""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_export.common.errors import InputError
from moe_export.runtime.chat import (
    OutputParser,
    generation_prompt_ids,
    output_starts_in_reasoning,
    render_prompt,
)
from moe_export.runtime.client.request_core import Tracked
from moe_export.runtime.core.budget import ReasoningBudget, ThinkingPlan, resolve_thinking
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.images import PromptImages
from moe_export.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from moe_export.runtime.core.contracts import GrammarSpec
    from moe_export.runtime.core.structured import GrammarLogitsProcessor, GrammarVocab


@dataclass
class RenderedChat:
    """A conversation rendered once: its prompt ids, the images of its `<|media_pad|>` runs in order, the
    thinking plan its effort resolved to, and what its choices' grammars need (tools, tool_choice,
    response_format)."""

    prompt_ids: list[int]
    images: list
    plan: ThinkingPlan
    tools: list | None = None
    tool_choice: object = None
    response_format: dict | None = None
    calls_before: int = 0  # where K3 numbers the new turn's call ids from (`calls_before`)
    history_len: int | None = None  # prompt tokens before what only this request adds after the conversation


class InputProcessor:
    """Turns requests into engine requests for one engine: its tokenizer and chat family (None: token ids only),
    its vision tower (or None), thinking caps and default effort, the turn memory (finished turns' tokens), the
    image URL fetcher, the model's vocabulary and the engine's sampling defaults."""

    def __init__(self, tokenizer, *, vision, thinking_caps: dict[str, int], default_effort: str,
                 turns: TurnMemory | None, fetch_image_url, vocab_size: int, default_sampling: SamplingParams,
                 engine_dir) -> None:
        self.tokenizer = tokenizer
        self.family = tokenizer.family if tokenizer is not None else None
        self.vision = vision
        self.thinking_caps, self.default_effort = thinking_caps, default_effort
        resolve_thinking(None, thinking_caps, default_effort)  # validates the default tier
        self.turns = turns
        self.fetch_image_url = fetch_image_url  # (url, where) -> bytes, or None: http(s) image parts refused
        self.vocab_size = vocab_size
        self.default_sampling = default_sampling
        self.engine_dir = engine_dir
        self._turn_start = {thinking: len(generation_prompt_ids(tokenizer, self.family, thinking))
                            for thinking in (True, False)} if self.family else {}
        self._ids = itertools.count()
        self._grammar_vocab: GrammarVocab | None = None

    def new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"req-{next(self._ids)}"

    # ---- plain prompts ----------------------------------------------------------------------------

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (text encoded; ids as given); InputError for anything else."""
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

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                 request_id: str | None = None) -> Tracked:
        """The engine request of a plain prompt."""
        return Tracked(self.new_id(request_id), self.prompt_ids(prompt), sampling or self.default_sampling, None, None)

    # ---- chats ------------------------------------------------------------------------------------

    def render(self, messages: list[dict], *, tools=None, reasoning_effort=None, tool_choice=None,
               response_format=None, add_generation_prompt: bool = True) -> RenderedChat:
        """Render a conversation (once per request): an assistant message that is a turn this engine generated
        (or that carries `turn_ids`) is rendered as the turn's tokens (`chat.render_prompt`); image parts become
        their media tokens (`runtime.images`)."""
        plan = resolve_thinking(reasoning_effort, self.thinking_caps, self.default_effort)
        if self.tokenizer is None:
            raise InputError("this LLM has no tokenizer (skip_tokenizer_init): chats need one; use generate() with "
                             "token ids")
        if self.family is None:
            raise InputError(f"{self.engine_dir}: the tokenizer has no K3 or K2 chat tokens: use generate()")
        vision = self.vision
        images = (PromptImages(self.tokenizer, vision.processor, messages, vision.max_images, self.fetch_image_url,
                               vision.cached) if vision is not None else None)
        carried = []
        if self.turns is not None and isinstance(messages, list):
            carried = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant" and m.get("turn_ids") is not None]
            messages = [self._recalled(m) for m in messages]
        ids, history_len = render_prompt(self.tokenizer, messages, family=self.family, tools=tools, thinking=plan.enabled,
                         thinking_effort=plan.tier, tool_choice=tool_choice, response_format=response_format,
                         add_generation_prompt=add_generation_prompt, vision=vision is not None, images=images)
        for m in carried:  # e.g. a stored Responses chain: the same turn sent back as text renders the same way
            self.turns.remember(m, m["turn_ids"])
        return RenderedChat(ids, images.order if images else [], plan, tools, tool_choice, response_format,
                            calls_before(messages), history_len)

    def _recalled(self, message):
        """`message` with the turn_ids remembered for it, if it is an assistant message without any."""
        if not isinstance(message, dict) or message.get("role") != "assistant" or message.get("turn_ids") is not None:
            return message
        ids = self.turns.recall(message)
        return message if ids is None else {**message, "turn_ids": ids}

    def chat_request(self, rendered: RenderedChat, sampling: SamplingParams | None = None, *,
                     parallel_tool_calls: bool = True, request_id: str | None = None) -> Tracked:
        """One choice of a rendered chat: its budget, output parser and grammar (a forced or required tool call
        or a JSON `response_format` is enforced by grammar-constrained decoding, the same way for every entry
        point)."""
        plan = rendered.plan
        starts = output_starts_in_reasoning(self.family, plan.enabled)
        budget = ReasoningBudget(self.tokenizer, self.family, plan.cap if plan.enabled else None, starts_in_reasoning=starts)
        parser = OutputParser(self.tokenizer, self.family, starts_in_reasoning=starts, tools_declared=bool(rendered.tools),
                              first_call_index=rendered.calls_before)
        next_turn = (functools.partial(self.next_turn_prompt, rendered)
                     if rendered.history_len is not None and not rendered.images else None)
        tracked = Tracked(self.new_id(request_id), list(rendered.prompt_ids), sampling or self.default_sampling, parser,
                          budget, self._turn_start[plan.enabled], images=list(rendered.images), thinking_tier=plan.tier,
                          turn_points=turn_points(rendered), next_turn=next_turn)
        if rendered.tools or rendered.response_format is not None:  # only these may need a grammar
            self._constrain(tracked, rendered, starts, parallel_tool_calls)
        return tracked

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, *, tools=None,
             reasoning_effort=None, tool_choice=None, response_format=None, parallel_tool_calls: bool = True,
             request_id: str | None = None) -> Tracked:
        """The engine request of a conversation (`render` + `chat_request`)."""
        rendered = self.render(messages, tools=tools, reasoning_effort=reasoning_effort, tool_choice=tool_choice,
                               response_format=response_format)
        return self.chat_request(rendered, sampling, parallel_tool_calls=parallel_tool_calls, request_id=request_id)

    def next_turn_prompt(self, rendered: RenderedChat, message: dict) -> list[int]:
        """The ids the next turn's prompt begins with after `rendered` (a chat whose prompt has K3's tool-choice /
        response-format message after the conversation: `history_len` set) was answered with `message` (the assistant
        message as the turn memory remembers it, `turn_ids` included): the conversation, then this turn rendered as
        the next prompt renders it (`chat.render_prompt`: its generated tokens and the rest of its rendering), up to
        where the next prompt's new messages begin. A K3 assistant message renders the same wherever it stands, so
        it is rendered alone: what it adds to the rendering of no message (the tool declarations, the effort)."""
        plan = rendered.plan
        kwargs = {"family": self.family, "tools": rendered.tools, "thinking": plan.enabled,
                  "thinking_effort": plan.tier, "add_generation_prompt": False}
        head = render_prompt(self.tokenizer, [], **kwargs)[0]
        alone = render_prompt(self.tokenizer, [message], **kwargs)[0]
        if alone[:len(head)] != head:
            raise InputError("the assistant message's rendering does not extend the conversation's start")
        return rendered.prompt_ids[:rendered.history_len] + alone[len(head):]

    def _constrain(self, tracked: Tracked, rendered: RenderedChat, starts: bool, parallel_tool_calls: bool) -> None:
        """Attach the grammar a request's tools or response_format enforce, if any (xgrammar, which pulls in
        transformers, is imported here: requests without either never load it)."""
        from moe_export.runtime.core.structured import structural_tag_for

        tag = structural_tag_for(self.family, tools=rendered.tools, tool_choice=rendered.tool_choice,
                                 response_format=rendered.response_format, thinking=rendered.plan.enabled,
                                 starts_in_reasoning=starts, parallel_tool_calls=parallel_tool_calls)
        if tag is not None:
            tracked.grammar = self.grammar_vocab().grammar(tag)

    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer as xgrammar sees it (built on the first constrained request, once per process)."""
        from moe_export.runtime.core.structured import GrammarVocab

        if self._grammar_vocab is None:
            self._grammar_vocab = GrammarVocab(self.tokenizer, self.family, self.vocab_size)
        return self._grammar_vocab

    def grammar(self, spec: GrammarSpec) -> GrammarLogitsProcessor:
        """A fresh grammar processor from its spec: a dp-layout group leader's copy of a request's grammar
        (`core.wide_ep`), built with this process's vocabulary."""
        from moe_export.runtime.core.structured import GrammarLogitsProcessor

        return GrammarLogitsProcessor(self.grammar_vocab(), spec)


def turn_points(rendered: RenderedChat) -> tuple[int, ...]:
    """Where the next turn's prompt may depart from this chat's (`Request.turn_points`): the end of the conversation
    before K3's tool-choice / response-format message (the next prompt holds this turn there), and the end of the
    prompt (the next prompt holds this turn's output there: as generated, or, from a client that sends it back
    without its reasoning, departing at once)."""
    end = len(rendered.prompt_ids)
    return (end,) if rendered.history_len is None else (rendered.history_len, end)


def calls_before(messages: list[dict]) -> int:
    """Where a new K3 turn's call ids count on from (settled before the turn is remembered: the turn memory's key
    holds the ids): the tool calls of the conversation's assistant messages, or past the highest K3 number among
    their ids where that is more (a turn whose output held a call that failed to parse skipped its number)."""
    calls = [c for m in messages if isinstance(m, dict) and m.get("role") == "assistant" for c in m.get("tool_calls") or ()]
    numbers = [int(n.group(1)) for c in calls if isinstance(c, dict)
               for n in [re.fullmatch(r"functions\.[^:]*:(\d+)", str(c.get("id")))] if n]
    return max([len(calls), *(n + 1 for n in numbers)])

"""The chat API: render a conversation to a prompt (text or token ids) and parse the model's output back
into a message. The formats live in `runtime/formats/`; this module picks the renderer and turns segments
into token ids.

Which renderer (`renderer_name` says it in words, `moe-export inspect ENGINE` prints it):
  - the checkpoint's own Jinja chat template when it ships one (`chat_template.jinja`, or `chat_template` in
    `tokenizer_config.json`; carried into the engine directory by the build): `runtime/formats/template.py`;
  - else the built-in renderer of the tokenizer's family: "k3" (`runtime/formats/k3.py`, the vendor's
    `encoding_k3.py`; K3 ships Python, not Jinja) or "k2" (`runtime/formats/k2.py`, K2-Thinking's template).

A rendered prompt is a list of `Segment`s: structural markers (special tokens, encoded one by one) and
text (encoded as ordinary text with special tokens disallowed, so a user typing `<|open|>` or `</think>`
cannot inject a control token). `render` joins them into a string; `render_ids` tokenizes them.

A turn the runtime generated re-renders to the text it was generated as, but its tokens may differ (BPE
encoding of the text need not be what the model sampled), so `render_ids` renders an assistant message that
carries its generated tokens (`turn_ids`) as those tokens, after checking they spell the message's
rendering: state reuse needs the exact tokens. A rendering that changed since the turn was generated (K2
drops past reasoning once a later plain answer exists) no longer matches, and the message renders from
its text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import FAMILIES
from moe_export.runtime.formats import k2, k3
from moe_export.runtime.formats.common import Rendered, Segment
from moe_export.runtime.formats.parsing import (
    OutputParser,
    ParsedDelta,
    ParsedMessage,
    ToolCallDelta,
    parse_output,
)
from moe_export.runtime.formats.template import ChatTemplate

if TYPE_CHECKING:
    from moe_export.runtime.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate", "OutputParser", "ParsedDelta", "ParsedMessage", "Segment", "ToolCallDelta", "generation_prompt_ids", "parse_output",
    "output_starts_in_reasoning", "render", "render_ids", "render_prompt", "render_segments", "renderer_name", "segments_to_ids",
]

EFFORTS = (*k3.EFFORTS, "none")
# assistant turns whose rendering from their turn ids is remembered (`_with_turn_ids`): the most recently used, up to
# TURN_CACHE_TOKENS turn ids in all (~70 bytes a token, key and value: ~70 MiB)
TURN_CACHE_TOKENS = 1 << 20


def render(
    messages: list[dict],
    *,
    family: str = "k3",
    tools: list[dict] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: str | dict | None = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    vision: bool = False,
    chat_template: ChatTemplate | None = None,
) -> str:
    """The prompt text of `messages` (OpenAI chat shape): with `chat_template`, that template's; else the
    built-in renderer of `family`.

    thinking: K3's thinking mode (the think channel, the thinking-effort message, the generation prompt).
    thinking_effort: "low" | "high" | "max" (K3's thinking-effort message; default max) or "none" (= thinking
    off). tool_choice ("required" / "none") and response_format ({"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": ...}}) add K3's internal system messages. K2's template has none
    of these (thinking, effort, tool choice and response format are left to the budget and constrained
    decoding), and a checkpoint template is given messages, tools and add_generation_prompt only.
    continue_final_message: leave the final assistant message open for the model to continue (K2 only; with
    add_generation_prompt=False). vision: the
    engine has a vision graph (K3: an image part renders as `<|kimi_image_placeholder|>`); without one image
    parts are an InputError."""
    return _render(
        messages, family=family, tools=tools, thinking=thinking, thinking_effort=thinking_effort, tool_choice=tool_choice,
        response_format=response_format, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, vision=vision, chat_template=chat_template,
    ).text


def render_segments(messages: list[dict], **kwargs: Any) -> list[Segment]:
    """`render` as segments (see the module docstring)."""
    return _render(messages, **kwargs).segments


def renderer_name(family: str | None, chat_template: ChatTemplate | None) -> str:
    """Which renderer serves an engine, in words."""
    if chat_template is not None:
        return f"checkpoint chat template ({chat_template.origin})"
    if family == "k3":
        return "built-in K3 (encoding_k3.py build_chat_segments)"
    if family == "k2":
        return "built-in K2 (Kimi-K2-Thinking chat template)"
    return "none (the tokenizer has no Kimi chat tokens and the checkpoint no chat template)"


def _render(messages: list[dict], *, family: str = "k3", tools: list[dict] | None = None, thinking: bool = True,
            thinking_effort: str | None = None, tool_choice: Any = None, response_format: Any = None,
            add_generation_prompt: bool = True, continue_final_message: bool = False, vision: bool = False,
            chat_template: ChatTemplate | None = None, special_tokens: tuple[str, ...] = ()) -> Rendered:
    if thinking_effort == "none":
        thinking, thinking_effort = False, None
    if family == "k3" and chat_template is None:
        k3.check_effort(thinking_effort)
    elif thinking_effort is not None and thinking_effort not in EFFORTS:
        raise InputError(f"thinking_effort must be one of {', '.join(EFFORTS)}, got {thinking_effort!r}")
    if continue_final_message and (chat_template is not None or family != "k2"):
        raise InputError("continue_final_message is supported by the built-in K2 renderer only")
    if chat_template is not None:
        return chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, special_tokens=special_tokens)
    check_family(family)
    if family == "k2":
        return k2.render_k2(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message)
    return k3.render_k3(
        messages, tools=tools, thinking=thinking, thinking_effort=thinking_effort, tool_choice=tool_choice,
        response_format=response_format, add_generation_prompt=add_generation_prompt, vision=vision,
    )


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise InputError(f"chat family must be one of {', '.join(FAMILIES)}, got {family!r}")


def render_ids(tokenizer: Tokenizer, messages: list[dict], *, family: str | None = None, **kwargs: Any) -> list[int]:
    """`render_prompt`'s token ids."""
    return render_prompt(tokenizer, messages, family=family, **kwargs)[0]


def render_prompt(tokenizer: Tokenizer, messages: list[dict], *, family: str | None = None,
                  **kwargs: Any) -> tuple[list[int], int | None]:
    """(token ids, history length) of `render(messages, **kwargs)` with the tokenizer's checkpoint chat template if
    it has one, else the built-in renderer of `family` (default: the tokenizer's): markers as special tokens, each
    text segment encoded alone with special tokens disallowed.

    An assistant message may carry `turn_ids`, the tokens the model produced for it (generation prompt and
    output; `ChatOutput.turn_ids`). When they spell the start of the message's rendering exactly (the same
    markers in the same places, the same decoded text between them; the output may end inside a text, or
    with one special token the format does not place there, such as [EOS]), the message is rendered as those
    tokens followed by the encoding of the rest of its rendering: the same prompt, tokenized as the model wrote
    it, so a kept session of that turn continues. Otherwise the message is encoded as usual. (Built-in
    renderers only: a checkpoint template's output has no message boundaries.)

    History length: the tokens before the internal messages K3 renders after the conversation (tool choice,
    response format; `Rendered.trailer_start`), where the next turn's prompt departs from this one (None: none)."""
    family = family or tokenizer.family
    images = kwargs.pop("images", None)  # runtime.images.PromptImages: the image parts' media tokens
    template = kwargs.pop("chat_template", None) or tokenizer.chat_template
    if family is None and template is None:
        raise InputError(f"{tokenizer.path}: the tokenizer has neither K3 nor K2 chat tokens nor a chat template; pass family=")
    rendered = _render(messages, family=family, chat_template=template, special_tokens=tuple(tokenizer.special_tokens), **kwargs)
    ids: list[int] = []
    done = 0
    for i, start, stop in rendered.assistant_spans:
        turn = messages[i].get("turn_ids")
        if turn is None:
            continue
        ids += segments_to_ids(tokenizer, rendered.segments[done:start], images)
        ids += _with_turn_ids(tokenizer, rendered.segments[start:stop], turn, f"messages[{i}]")
        done = stop
    trailer = rendered.trailer_start
    if trailer is None:
        return ids + segments_to_ids(tokenizer, rendered.segments[done:], images), None
    ids += segments_to_ids(tokenizer, rendered.segments[done:trailer], images)
    return ids + segments_to_ids(tokenizer, rendered.segments[trailer:], images), len(ids)


def _with_turn_ids(tokenizer: Tokenizer, segments: list[Segment], turn: Any, where: str) -> list[int]:
    """One assistant message's ids: `turn` + the rest of `segments` when `turn` spells their start (or all
    of it but a final special token, up to a marker), else the segments' own encoding."""
    if not isinstance(turn, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in turn):
        raise InputError(f"{where}.turn_ids must be a list of token ids")
    key = (tokenizer, tuple(seg.text for seg in segments), tuple(seg.special for seg in segments), tuple(turn))
    return list(TURNS_RENDERED.get(key, lambda: _turn_ids_rendered(*key)))


class RenderedTurns:
    """An LRU of rendered turns (`_with_turn_ids`: every request of a conversation renders its earlier turns again, each
    walk decoding the turn's text runs), keyed by (tokenizer, segment texts, special flags, turn ids), within
    `max_tokens` turn ids in all. Thread-safe."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._items: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, make) -> tuple[int, ...]:
        """The ids remembered under `key`, else `make()`'s (remembered unless the turn alone is over the cap)."""
        with self._lock:
            ids = self._items.get(key)
            if ids is not None:
                self._items.move_to_end(key)
                return ids
        ids = make()
        if len(key[3]) <= self.max_tokens:
            with self._lock:
                if key not in self._items:
                    self._items[key] = ids
                    self.tokens += len(key[3])
                while self.tokens > self.max_tokens:
                    old, _ = self._items.popitem(last=False)
                    self.tokens -= len(old[3])
        return ids

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.tokens = 0


TURNS_RENDERED = RenderedTurns(TURN_CACHE_TOKENS)


def _turn_ids_rendered(tokenizer: Tokenizer, texts: tuple[str, ...], specials: tuple[bool, ...],
                       turn: tuple[int, ...]) -> tuple[int, ...]:
    """`_with_turn_ids` of one assistant message's segments (their texts and special flags) and turn ids."""
    segments = [Segment(text, special) for text, special in zip(texts, specials)]
    ids = list(turn)
    rest = _rest_after(tokenizer, segments, ids, inside_text=True)
    if rest is None and ids and tokenizer.is_special(ids[-1]):
        ids = ids[:-1]
        rest = _rest_after(tokenizer, segments, ids, inside_text=False)
    return tuple(segments_to_ids(tokenizer, segments) if rest is None else ids + segments_to_ids(tokenizer, rest))


def _rest_after(tokenizer: Tokenizer, segments: list[Segment], ids: list[int], *, inside_text: bool) -> list[Segment] | None:
    """The segments left to render after `ids`, or None when `ids` do not spell the start of `segments`:
    each special token must be the marker in its place, each run of text tokens must decode to the text
    between markers (with inside_text, the last run may stop inside it; the rest keeps the segments' cuts)."""
    items: list[tuple[Segment, int]] = []  # markers, and adjacent text segments merged; index of the first
    for n, seg in enumerate(segments):
        if not seg.special and items and not items[-1][0].special:
            items[-1] = (Segment(items[-1][0].text + seg.text), items[-1][1])
        else:
            items.append((seg, n))
    # special tokens that are neither a marker of this rendering nor an end token carry no text (a sampled
    # reserved token): inside a text run they belong to it, as the output parser read them
    markers = {tokenizer.encode_special(seg.text) for seg in segments if seg.special} | set(tokenizer.eos_token_ids)

    def textless(n: int) -> bool:
        return tokenizer.is_special(ids[n]) and ids[n] not in markers

    k = i = 0
    while i < len(ids):
        if tokenizer.is_special(ids[i]) and not textless(i):
            if k == len(items) or not items[k][0].special or tokenizer.encode_special(items[k][0].text) != ids[i]:
                return None
            k, i = k + 1, i + 1
            continue
        j = i
        while j < len(ids) and (not tokenizer.is_special(ids[j]) or textless(j)):
            j += 1
        if k == len(items) or items[k][0].special:
            return None
        text, want = tokenizer.decode(ids[i:j], skip_special_tokens=True), items[k][0].text
        if text == want:
            k, i = k + 1, j
        elif inside_text and j == len(ids) and want.startswith(text):
            n, skip = items[k][1], len(text)
            while skip >= len(segments[n].text):
                skip -= len(segments[n].text)
                n += 1
            return [Segment(segments[n].text[skip:]), *segments[n + 1:]]
        else:
            return None
    return segments[items[k][1]:] if k < len(items) else []


def segments_to_ids(tokenizer: Tokenizer, segments: list[Segment], images=None) -> list[int]:
    """Tokenize segments: each marker as its special token, each text segment alone as ordinary text. `images`
    (`runtime.images.PromptImages`) expands each image marker into its media tokens."""
    ids: list[int] = []
    for seg in segments:
        if seg.special and seg.source is not None and images is not None:
            ids += images.expand(seg.source)
        elif seg.special:
            ids.append(tokenizer.encode_special(seg.text))
        else:
            ids += tokenizer.encode(seg.text)
    return ids


def prompt_starts_in_reasoning(family: str, thinking: bool) -> bool:
    """Whether the generation prompt itself opened the think block: K3's `<|open|>think<|sep|>` with thinking on;
    never K2's (K2-Thinking's generation prompt is `<|im_assistant|>assistant<|im_middle|>`; the model writes
    `<think>` itself). `output_starts_in_reasoning` says how the output is read."""
    check_family(family)
    return family == "k3" and bool(thinking)


def output_starts_in_reasoning(family: str, thinking: bool) -> bool:
    """Whether the model's output is read as starting inside reasoning: with thinking on, in both families.
    K3's generation prompt opens the think element; K2-Thinking's (`<|im_assistant|>assistant<|im_middle|>`)
    does not, but its output is reasoning until `</think>` or a tool section, whether or not the model
    writes `<think>` first (as vLLM's kimi_k2 parser reads it). A K2-family model that does not reason
    (Kimi Linear Instruct, K2-Instruct) is served with thinking off (`--default-effort none`)."""
    check_family(family)
    return bool(thinking)


def generation_prompt_ids(tokenizer: Tokenizer, family: str, thinking: bool) -> list[int]:
    """Ids of the generation prompt (the end of every prompt rendered with add_generation_prompt): the start
    of the assistant turn the model writes. For a checkpoint template: what rendering with the generation
    prompt adds to a one-message conversation."""
    template = tokenizer.chat_template
    if template is not None:
        probe = [{"role": "user", "content": "Hi"}]
        specials = tuple(tokenizer.special_tokens)
        without = segments_to_ids(tokenizer, template.render(probe, add_generation_prompt=False, special_tokens=specials).segments)
        with_prompt = segments_to_ids(tokenizer, template.render(probe, add_generation_prompt=True, special_tokens=specials).segments)
        if with_prompt[:len(without)] != without:
            raise InputError(f"{template.origin}: the generation prompt does not extend the conversation's rendering")
        return with_prompt[len(without):]
    check_family(family)
    segments = k3.generation_prompt_segments(thinking) if family == "k3" else k2.generation_prompt_segments()
    return segments_to_ids(tokenizer, segments)

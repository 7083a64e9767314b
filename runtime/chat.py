"""The chat API: render a conversation to a prompt (text or token ids) and parse the model's output back
into a message. The formats themselves live in `runtime/formats/` (one module per family, the marker table,
the output parser); this module picks the renderer and turns segments into token ids.

Two families (sources: `runtime/formats/markers.py`):
  "k3"  XTML (`runtime/formats/k3.py`).
  "k2"  role tokens, K2 and Kimi Linear (`runtime/formats/k2.py`).

A rendered prompt is a list of `Segment`s: structural markers (special tokens, encoded one by one) and
text (encoded as ordinary text with special tokens disallowed, so a user typing `<|open|>` or `</think>`
cannot inject a control token). `render` joins them into a string; `render_ids` tokenizes them.

A turn the runtime generated re-renders to the text it was generated as, but its tokens may differ (BPE
encoding of the text need not be what the model sampled), so `render_ids` renders an assistant message that
carries its generated tokens (`turn_ids`) as those tokens, after checking they spell the message's
rendering: state reuse needs the exact tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_export.export.errors import InputError
from moe_export.runtime.core.budget import EFFORT_TIERS
from moe_export.runtime.formats.common import Renderer, Segment, check_family, response_format_of, tool_choice_of
from moe_export.runtime.formats.k2 import K2Renderer
from moe_export.runtime.formats.k3 import K3Renderer
from moe_export.runtime.formats.parsing import OutputParser, ParsedDelta, ParsedMessage, parse_output

if TYPE_CHECKING:
    from moe_export.runtime.tokenizer import Tokenizer

__all__ = [
    "OutputParser", "ParsedDelta", "ParsedMessage", "Segment", "generation_prompt_ids", "parse_output",
    "prompt_starts_in_reasoning", "render", "render_ids", "render_segments", "segments_to_ids",
]

_RENDERERS = {"k3": K3Renderer, "k2": K2Renderer}


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
    vision: bool = False,
) -> str:
    """The prompt text of `messages` (OpenAI chat shape) in `family`'s format.

    thinking_effort: "low" | "high" | "max" (K3's thinking-effort message; default max when thinking is
    on) or "none" (= thinking off). tool_choice: "auto" | "none" | "required" | {"type": "function",
    "function": {"name": ...}}. response_format: {"type": "text" | "json_object" | "json_schema", ...}.
    The thinking-effort / tool-choice / response-format system messages are K3's; K2 has none (its
    tool choice and response format are left to constrained decoding). vision: the engine has a vision
    graph (K3: image parts render as `<|kimi_image_placeholder|>`); without one image parts are an InputError."""
    segments = render_segments(
        messages, family=family, tools=tools, thinking=thinking, thinking_effort=thinking_effort,
        tool_choice=tool_choice, response_format=response_format, add_generation_prompt=add_generation_prompt,
        vision=vision,
    )
    return "".join(s.text for s in segments)


def render_ids(tokenizer: Tokenizer, messages: list[dict], *, family: str | None = None, **kwargs: Any) -> list[int]:
    """Token ids of `render(messages, **kwargs)`: markers as special tokens, text runs with special
    tokens disallowed. `family` defaults to the tokenizer's.

    An assistant message may carry `turn_ids`, the tokens the model produced for it (generation prompt and
    output; `ChatOutput.turn_ids`). When they spell the start of the message's rendering exactly (the same
    markers in the same places, the same decoded text between them; the output may end inside a text, or
    with one special token the format does not place there, such as [EOS]), the message is rendered as those
    tokens followed by the encoding of the rest of its rendering: the same prompt, tokenized as the model wrote
    it, so a kept session of that turn continues. Otherwise the message is encoded as usual."""
    family = family or tokenizer.family
    if family is None:
        raise InputError(f"{tokenizer.path}: the tokenizer has neither K3 nor K2 chat tokens; pass family=")
    images = kwargs.pop("images", None)  # runtime.images.PromptImages: the image parts' media tokens
    renderer = _render(messages, family=family, **kwargs)
    ids: list[int] = []
    done = 0
    for i, start, stop in renderer.assistant_spans:
        turn = messages[i].get("turn_ids")
        if turn is None:
            continue
        ids += segments_to_ids(tokenizer, renderer.out[done:start], images)
        ids += _with_turn_ids(tokenizer, renderer.out[start:stop], turn, f"messages[{i}]")
        done = stop
    return ids + segments_to_ids(tokenizer, renderer.out[done:], images)


def _with_turn_ids(tokenizer: Tokenizer, segments: list[Segment], turn: Any, where: str) -> list[int]:
    """One assistant message's ids: `turn` + the rest of `segments` when `turn` spells their start (or all
    of it but a final special token, up to a marker), else the segments' own encoding."""
    if not isinstance(turn, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in turn):
        raise InputError(f"{where}.turn_ids must be a list of token ids")
    rest = _rest_after(tokenizer, segments, turn, inside_text=True)
    if rest is None and turn and tokenizer.is_special(turn[-1]):
        turn = turn[:-1]
        rest = _rest_after(tokenizer, segments, turn, inside_text=False)
    return segments_to_ids(tokenizer, segments) if rest is None else turn + segments_to_ids(tokenizer, rest)


def _rest_after(tokenizer: Tokenizer, segments: list[Segment], ids: list[int], *, inside_text: bool) -> list[Segment] | None:
    """The segments left to render after `ids`, or None when `ids` do not spell the start of `segments`:
    each special token must be the marker in its place, each run of text tokens must decode to the text
    between markers (with inside_text, the last run may stop inside it)."""
    items: list[Segment] = []  # markers, and adjacent text segments merged
    for seg in segments:
        if not seg.special and items and not items[-1].special:
            items[-1] = Segment(items[-1].text + seg.text)
        else:
            items.append(seg)
    k = i = 0
    while i < len(ids):
        if tokenizer.is_special(ids[i]):
            if k == len(items) or not items[k].special or tokenizer.encode_special(items[k].text) != ids[i]:
                return None
            k, i = k + 1, i + 1
            continue
        j = i
        while j < len(ids) and not tokenizer.is_special(ids[j]):
            j += 1
        if k == len(items) or items[k].special:
            return None
        text, want = tokenizer.decode(ids[i:j]), items[k].text
        if text == want:
            k, i = k + 1, j
        elif inside_text and j == len(ids) and want.startswith(text):
            return [Segment(want[len(text):]), *items[k + 1:]]
        else:
            return None
    return items[k:]


def segments_to_ids(tokenizer: Tokenizer, segments: list[Segment], images=None) -> list[int]:
    """Tokenize segments: each marker alone, each maximal run of adjacent text as one string. `images`
    (`runtime.images.PromptImages`) expands each image marker into its media tokens."""
    ids: list[int] = []
    run: list[str] = []
    for seg in segments:
        if seg.special:
            ids += tokenizer.encode("".join(run))
            run = []
            if seg.source is not None and images is not None:
                ids += images.expand(seg.source)
                continue
            ids.append(tokenizer.encode_special(seg.text))
        else:
            run.append(seg.text)
    return ids + tokenizer.encode("".join(run))


def prompt_starts_in_reasoning(family: str, thinking: bool) -> bool:
    """Whether the generation prompt opened the think block (K3 `<|open|>think<|sep|>`, K2 `<think>`)."""
    check_family(family)
    return bool(thinking)


def generation_prompt_ids(tokenizer: Tokenizer, family: str, thinking: bool) -> list[int]:
    """Ids of the generation prompt (the end of every prompt rendered with add_generation_prompt): the start
    of the assistant turn the model writes."""
    check_family(family)
    renderer = _RENDERERS[family](thinking, False)
    renderer.generation_prompt()
    return segments_to_ids(tokenizer, renderer.out)


def render_segments(
    messages: list[dict],
    *,
    family: str = "k3",
    tools: list[dict] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: str | dict | None = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
    vision: bool = False,
) -> list[Segment]:
    """`render` as segments (see the module docstring)."""
    return _render(
        messages, family=family, tools=tools, thinking=thinking, thinking_effort=thinking_effort, tool_choice=tool_choice,
        response_format=response_format, add_generation_prompt=add_generation_prompt, vision=vision,
    ).out


def _render(messages: list[dict], *, family: str, tools: list[dict] | None = None, thinking: bool = True,
            thinking_effort: str | None = None, tool_choice: str | dict | None = None, response_format: dict | None = None,
            add_generation_prompt: bool = True, vision: bool = False) -> Renderer:
    """The renderer after rendering `messages`: its segments and where each assistant message lies in them."""
    check_family(family)
    if thinking_effort is not None and thinking_effort not in (*EFFORT_TIERS, "none"):
        raise InputError(f"thinking_effort must be one of {', '.join((*EFFORT_TIERS, 'none'))}, got {thinking_effort!r}")
    if thinking_effort == "none":
        thinking = False
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InputError("messages must be a list of objects")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError("tools must be a list of tool objects")
    choice = tool_choice_of(tool_choice)
    fmt = response_format_of(response_format)
    renderer = _RENDERERS[family](thinking, vision)
    renderer.preamble(tools or [], "max" if thinking_effort is None else thinking_effort, choice, fmt, messages)
    i = 0
    while i < len(messages):
        role = messages[i].get("role")
        if role == "tool":
            j = i
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            renderer.tool_results(messages, i, j)
            i = j
            continue
        if role in ("system", "developer", "user"):
            renderer.plain(messages[i], i, "system" if role == "developer" else role)
        elif role == "assistant":
            start = len(renderer.out)
            renderer.assistant(messages[i], i)
            renderer.assistant_spans.append((i, start, len(renderer.out)))
        else:
            raise InputError(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}")
        i += 1
    if add_generation_prompt:
        renderer.generation_prompt()
    return renderer

"""Kimi chat formats: render a conversation to a prompt, parse the model's output back into a message.

Two families (facts: shared/reference/kimi-chat-format.md):
  "k3"  XTML: `<|open|>TAG attrs<|sep|> ... <|close|>TAG<|sep|>`, each message ended by `<|end_of_msg|>`;
        assistant bodies hold think / response / tools elements.
  "k2"  role tokens (K2, Kimi Linear): `<|im_user|>user<|im_middle|>...<|im_end|>`, reasoning in
        `<think>...</think>`, tool calls in `<|tool_calls_section_begin|>...` sections.

A rendered prompt is a list of `Segment`s: structural markers (special tokens, encoded one by one) and
text (encoded as ordinary text with special tokens disallowed, so a user typing `<|open|>` or `</think>`
cannot inject a control token). `render` joins them into a string; `render_ids` tokenizes them.

History is rendered verbatim: every past assistant turn's reasoning and tool calls, never dropped or
shortened. With thinking on, a turn without reasoning renders an empty think element, so a turn the
runtime generated re-renders to the text it was generated as. Its tokens may still differ (BPE encoding of
the text need not be what the model sampled), so `render_ids` renders an assistant message that carries
its generated tokens (`turn_ids`) as those tokens, after checking they spell the message's rendering:
state reuse needs the exact tokens.

Parsing works on token ids: markers are special tokens, so the parser knows a marker from text that
merely looks like one. Streaming (`OutputParser.feed`) returns reasoning / content text deltas; a tag
header (`<|open|>think` before its `<|sep|>`) and an incomplete UTF-8 character are held back until
complete; no marker ever reaches content. Tool calls are returned by `finish()` in OpenAI shape
(`arguments` a JSON string). A tool call that does not parse becomes content (its decoded tokens, as the
model wrote them) and is counted in `tool_call_parse_failures`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from moe_export.export.errors import InputError
from moe_export.runtime.core.budget import EFFORT_TIERS
from moe_export.runtime.tokenizer import Tokenizer

FAMILIES = ("k3", "k2")
K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
TOOL_DECLARE_HEADER = "# Tools\n\nYou can call the following tools. Their definitions, in JSON:\n"
TOOL_CHOICE_TEXT = {
    "required": "You must call at least one of the declared tools in this turn.",
    "none": "Do not call any tool in this turn; answer directly.",
}
IMAGE_PART_TYPES = ("image", "image_url", "input_image")

# K3 markers
OPEN, CLOSE, SEP, END_OF_MSG, IMAGE = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>"
# K2 markers
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt: a special-token name (`special`) or ordinary text."""

    text: str
    special: bool = False


# ---------------------------------------------------------------------------------------------- render


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
    renderer = _render(messages, family=family, **kwargs)
    ids: list[int] = []
    done = 0
    for i, start, stop in renderer.assistant_spans:
        turn = messages[i].get("turn_ids")
        if turn is None:
            continue
        ids += segments_to_ids(tokenizer, renderer.out[done:start])
        ids += _with_turn_ids(tokenizer, renderer.out[start:stop], turn, f"messages[{i}]")
        done = stop
    return ids + segments_to_ids(tokenizer, renderer.out[done:])


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


def segments_to_ids(tokenizer: Tokenizer, segments: list[Segment]) -> list[int]:
    """Tokenize segments: each marker alone, each maximal run of adjacent text as one string."""
    ids: list[int] = []
    run: list[str] = []
    for seg in segments:
        if seg.special:
            ids += tokenizer.encode("".join(run))
            run = []
            ids.append(tokenizer.encode_special(seg.text))
        else:
            run.append(seg.text)
    return ids + tokenizer.encode("".join(run))


def prompt_starts_in_reasoning(family: str, thinking: bool) -> bool:
    """Whether the generation prompt opened the think block (K3 `<|open|>think<|sep|>`, K2 `<think>`)."""
    _check_family(family)
    return bool(thinking)


def generation_prompt_ids(tokenizer: Tokenizer, family: str, thinking: bool) -> list[int]:
    """Ids of the generation prompt (the end of every prompt rendered with add_generation_prompt): the start
    of the assistant turn the model writes."""
    _check_family(family)
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
            add_generation_prompt: bool = True, vision: bool = False) -> _Renderer:
    """The renderer after rendering `messages`: its segments and where each assistant message lies in them."""
    _check_family(family)
    if thinking_effort is not None and thinking_effort not in (*EFFORT_TIERS, "none"):
        raise InputError(f"thinking_effort must be one of {', '.join((*EFFORT_TIERS, 'none'))}, got {thinking_effort!r}")
    if thinking_effort == "none":
        thinking = False
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InputError("messages must be a list of objects")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError("tools must be a list of tool objects")
    choice = _tool_choice(tool_choice)
    fmt = _response_format(response_format)
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


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise InputError(f"chat family must be one of {', '.join(FAMILIES)}, got {family!r}")


def _tool_choice(choice: str | dict | None) -> str | None:
    """None (auto), "none", "required", or the name of the one tool that must be called."""
    if choice is None or choice == "auto":
        return None
    if choice in ("none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return f"function:{name}"
    raise InputError(f"tool_choice must be auto, none, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")


def _response_format(fmt: dict | None) -> dict | None:
    """None for plain text, else {"type": "json_object"} or {"type": "json_schema", "schema": {...}}."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InputError("response_format.json_schema.schema must be a JSON schema object")
        return {"type": "json_schema", "schema": schema}
    raise InputError(f"response_format.type must be text, json_object or json_schema, got {fmt!r}")


def _arguments_value(call: dict, where: str) -> Any:
    """A tool call's arguments as a JSON value (OpenAI sends a JSON string; a dict is accepted too)."""
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}.function.arguments is not valid JSON ({exc})") from None
    return args


def _call_name(call: Any, where: str) -> str:
    name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}.function.name must be a non-empty string")
    return name


class _Renderer:
    """Shared helpers: output segments, message text with image parts, tool-result grouping."""

    def __init__(self, thinking: bool, vision: bool) -> None:
        self.thinking = thinking
        self.vision = vision
        self.out: list[Segment] = []
        self.assistant_spans: list[tuple[int, int, int]] = []  # (message index, start, stop) in `out`

    def mark(self, name: str) -> None:
        self.out.append(Segment(name, special=True))

    def text(self, text: str) -> None:
        if text:
            self.out.append(Segment(text))

    def body(self, content: Any, where: str) -> None:
        """Message content: a string, None, or a list of text / image parts."""
        if content is None or isinstance(content, str):
            self.text(content or "")
            return
        if not isinstance(content, list):
            raise InputError(f"{where}.content must be a string or a list of content parts")
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                self.text(part["text"])
            elif kind in IMAGE_PART_TYPES:
                if not self.vision:
                    raise InputError(f"{where}.content[{k}] is an image, but this engine has no vision graph (text only)")
                self.image(f"{where}.content[{k}]")
            else:
                raise InputError(f"{where}.content[{k}] must be a text part or an image part, got type {kind!r}")

    def image(self, where: str) -> None:
        raise InputError(f"{where}: images are not supported in this chat format")

    def tool_results(self, messages: list[dict], start: int, stop: int) -> None:
        """Tool messages[start:stop], reordered to the preceding assistant's call order when every
        `tool_call_id` names one of its calls; each gets the 1-based index of its call (else its position)."""
        calls: list[dict] = []
        if start > 0 and messages[start - 1].get("role") == "assistant":
            calls = messages[start - 1].get("tool_calls") or []
        ids = [c.get("id") for c in calls if isinstance(c, dict)]
        run = list(range(start, stop))
        wanted = [messages[i].get("tool_call_id") for i in run]
        if ids and all(w in ids for w in wanted) and len(set(wanted)) == len(wanted):
            ordered = sorted(zip(run, wanted), key=lambda p: ids.index(p[1]))
            items = [(i, ids.index(w) + 1, calls[ids.index(w)]) for i, w in ordered]
        else:
            items = [(i, k + 1, None) for k, i in enumerate(run)]
        for i, index, call in items:
            name = _call_name(call, f"messages[{i}]") if call else messages[i].get("name")
            self.tool_result(messages[i], i, index, name)


class _K3(_Renderer):
    """K3 XTML."""

    def image(self, where: str) -> None:
        self.mark(IMAGE)

    def open_tag(self, name: str, *attrs: tuple[str, Any]) -> None:
        self.mark(OPEN)
        self.text(name + "".join(f' {k}="{_escape(str(v))}"' for k, v in attrs))
        self.mark(SEP)

    def close_tag(self, name: str) -> None:
        self.mark(CLOSE)
        self.text(name)
        self.mark(SEP)

    def system(self, kind: str, body: str) -> None:
        self.open_tag("message", ("role", "system"), ("type", kind))
        self.text(body)
        self.end_message()

    def end_message(self) -> None:
        self.close_tag("message")
        self.mark(END_OF_MSG)

    def preamble(self, tools: list[dict], effort: str, choice: str | None, fmt: dict | None, messages: list[dict]) -> None:
        if tools:
            self.system("tool-declare", TOOL_DECLARE_HEADER + "```json\n" + _sorted_json(tools) + "\n```")
        if self.thinking:
            self.system("thinking-effort", f"Thinking effort: {effort}.")
        if choice is not None:
            text = TOOL_CHOICE_TEXT.get(choice) or f"You must call the tool `{choice.split(':', 1)[1]}` in this turn."
            self.system("tool-choice", text)
        if fmt is not None:
            text = "Respond with one JSON object and nothing else."
            if fmt["type"] == "json_schema":
                text = "Respond with one JSON value that matches this JSON schema, and nothing else:\n```json\n" + _sorted_json(fmt["schema"]) + "\n```"
            self.system("response-format", text)

    def plain(self, msg: dict, i: int, role: str) -> None:
        attrs = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
        self.open_tag("message", *attrs)
        self.body(msg.get("content"), f"messages[{i}]")
        self.end_message()

    def assistant(self, msg: dict, i: int) -> None:
        where = f"messages[{i}]"
        self.open_tag("message", ("role", "assistant"))
        reasoning = _reasoning_of(msg, where)
        if self.thinking or reasoning:
            self.open_tag("think")
            self.text(reasoning)
            self.close_tag("think")
        self.open_tag("response")
        self.body(msg.get("content"), where)
        self.close_tag("response")
        calls = _tool_calls_of(msg, where)
        if calls:
            self.open_tag("tools")
            for k, call in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                self.open_tag("call", ("tool", _call_name(call, cw)), ("index", k + 1))
                args = _arguments_value(call, cw)
                if isinstance(args, dict):
                    for key, value in args.items():
                        kind, text = _argument_text(value)
                        self.open_tag("argument", ("key", key), ("type", kind))
                        self.text(text)
                        self.close_tag("argument")
                else:
                    self.open_tag("json", ("type", "object"))
                    self.text(json.dumps(args, ensure_ascii=False))
                    self.close_tag("json")
                self.close_tag("call")
            self.close_tag("tools")
        self.end_message()

    def tool_result(self, msg: dict, i: int, index: int, name: str | None) -> None:
        self.open_tag("message", ("role", "tool"), ("tool", name or ""), ("index", index))
        self.body(msg.get("content"), f"messages[{i}]")
        self.end_message()

    def generation_prompt(self) -> None:
        self.open_tag("message", ("role", "assistant"))
        self.open_tag("think" if self.thinking else "response")


class _K2(_Renderer):
    """K2 / Kimi Linear role tokens."""

    def __init__(self, thinking: bool, vision: bool) -> None:
        super().__init__(thinking, vision)
        self.call_counter = 0  # K2 call ids are functions.NAME:IDX, IDX counting calls in the conversation

    def message(self, start: str, header: str) -> None:
        self.mark(start)
        self.text(header)
        self.mark(IM_MIDDLE)

    def preamble(self, tools: list[dict], effort: str, choice: str | None, fmt: dict | None, messages: list[dict]) -> None:
        if tools:
            self.message(IM_SYSTEM, "tool_declare")
            self.text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))
            self.mark(IM_END)
        if not messages or messages[0].get("role") not in ("system", "developer"):
            self.message(IM_SYSTEM, "system")
            self.text(K2_DEFAULT_SYSTEM)
            self.mark(IM_END)

    def plain(self, msg: dict, i: int, role: str) -> None:
        self.message(IM_SYSTEM if role == "system" else IM_USER, msg.get("name") or role)
        self.body(msg.get("content"), f"messages[{i}]")
        self.mark(IM_END)

    def assistant(self, msg: dict, i: int) -> None:
        where = f"messages[{i}]"
        self.message(IM_ASSISTANT, msg.get("name") or "assistant")
        reasoning = _reasoning_of(msg, where)
        if self.thinking or reasoning:
            self.mark(THINK)
            self.text(reasoning)
            self.mark(END_THINK)
        self.body(msg.get("content"), where)
        calls = _tool_calls_of(msg, where)
        if calls:
            self.mark(CALLS_BEGIN)
            for k, call in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                name = _call_name(call, cw)
                call_id = call.get("id") or f"functions.{name}:{self.call_counter}"
                self.call_counter += 1
                args = (call.get("function") or {}).get("arguments", "{}")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                self.mark(CALL_BEGIN)
                self.text(call_id)
                self.mark(CALL_ARGS)
                self.text(args)
                self.mark(CALL_END)
            self.mark(CALLS_END)
        self.mark(IM_END)

    def tool_result(self, msg: dict, i: int, index: int, name: str | None) -> None:
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InputError(f"messages[{i}].tool_call_id is required for tool results (K2 format: '## Return of ID')")
        self.message(IM_SYSTEM, "tool")
        self.text(f"## Return of {call_id}\n")
        self.body(msg.get("content"), f"messages[{i}]")
        self.mark(IM_END)

    def generation_prompt(self) -> None:
        self.message(IM_ASSISTANT, "assistant")
        if self.thinking:
            self.mark(THINK)


_RENDERERS = {"k3": _K3, "k2": _K2}


def _reasoning_of(msg: dict, where: str) -> str:
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise InputError(f"{where}.reasoning_content must be a string")
    return reasoning or ""


def _tool_calls_of(msg: dict, where: str) -> list[dict]:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InputError(f"{where}.tool_calls must be a list of tool-call objects")
    return calls


def _argument_text(value: Any) -> tuple[str, str]:
    """(XTML type, element text) of one argument value: strings raw, everything else as JSON."""
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, (int, float)):
        kind = "number"
    elif value is None:
        kind = "null"
    elif isinstance(value, dict):
        kind = "object"
    else:
        kind = "array"
    return kind, json.dumps(value, ensure_ascii=False)


def _sorted_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


# ---------------------------------------------------------------------------------------------- parse


@dataclass
class ParsedDelta:
    """New text of one `feed` call, by channel."""

    reasoning: str = ""
    content: str = ""


@dataclass
class ParsedMessage:
    """A whole parsed assistant output (OpenAI fields; None where empty)."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    tool_call_parse_failures: int = 0


@dataclass
class _Call:
    """A tool call being read: its raw tokens (for the failure path) and parsed parts."""

    ids: list[int] = field(default_factory=list)
    name: str | None = None
    call_id: str | None = None
    args: dict | None = None  # K3 argument elements read so far
    json_text: str | None = None  # K3 json block text (None: no block)
    json_done: bool = False
    arg_key: str | None = None
    arg_type: str | None = None
    arg_text: str = ""
    header: str = ""  # K2: the call id text before the argument marker
    error: str | None = None


class OutputParser:
    """Streaming parser of one assistant output (token ids after the generation prompt).

    feed(ids) -> ParsedDelta of new reasoning / content text; finish() -> ParsedMessage. After finish(),
    `delta` holds the text finish() itself added (an unfinished tool call, a held-back character): stream
    it as the last delta."""

    def __init__(self, tokenizer: Tokenizer, family: str, *, starts_in_reasoning: bool, tools_declared: bool = True) -> None:
        _check_family(family)
        self.tok = tokenizer
        self.family = family
        self.tools_declared = tools_declared
        self.channel = "reasoning" if starts_in_reasoning else "content"  # | "tools"
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict] = []
        self.failures = 0
        self.failure_reasons: list[str] = []  # why each failed call did not parse (for logs)
        self.run = tokenizer.incremental_decoder()
        self.names = {i: n for n, i in tokenizer.special_tokens.items()}
        self.header: str | None = None  # K3: text of an open / close tag before its <|sep|>
        self.header_kind = ""
        self.header_ids: list[int] = []  # K3: the tag's tokens so far
        self.call: _Call | None = None
        self.delta = ParsedDelta()

    # -- output channels
    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.header is not None:
            self.header += text
        elif self.call is not None:
            self._call_text(text)
        elif self.channel == "reasoning":
            self.reasoning.append(text)
            self.delta.reasoning += text
        elif self.channel == "content":
            self.content.append(text)
            self.delta.content += text
        # text between calls inside a tool section is dropped (it is not part of any message field)

    def _emit_content(self, text: str) -> None:
        self.content.append(text)
        self.delta.content += text

    def feed(self, token_ids: list[int]) -> ParsedDelta:
        """Consume new output tokens; return the reasoning / content text they complete."""
        self.delta = ParsedDelta()
        for t in token_ids:
            t = int(t)
            if self.call is not None:
                self.call.ids.append(t)
            name = self.names.get(t)
            if self.family == "k3" and name in (OPEN, CLOSE):
                self.header_ids = [t]
            elif self.header is not None:
                self.header_ids.append(t)
            if name is None:
                self._emit(self.run.push([t]))
                continue
            self._emit(self.run.flush())
            if self.family == "k3":
                self._k3_special(name)
            else:
                self._k2_special(name)
        return self.delta

    def feed_text(self, text: str) -> ParsedDelta:
        """Consume output text that is not a whole token: the start of a token the output was cut inside
        (at a stop string), after whole tokens that ended a character."""
        self.delta = ParsedDelta()
        self._emit(self.run.flush())
        self._emit(text)
        return self.delta

    def finish(self) -> ParsedMessage:
        """End of output: flush, turn an unfinished tool call into content, return the message."""
        self.delta = ParsedDelta()
        self._emit(self.run.flush())
        self.header = None  # an unfinished tag header is a marker fragment: never content
        if self.call is not None:
            self._fail(self.call, "the output ended inside the call")
            self.call = None
        reasoning = "".join(self.reasoning)
        content = "".join(self.content)
        return ParsedMessage(
            reasoning_content=reasoning or None,
            content=content or None,
            tool_calls=self.tool_calls,
            tool_call_parse_failures=self.failures,
        )

    # -- K3
    def _k3_special(self, name: str) -> None:
        if name in (OPEN, CLOSE):
            if self.header is not None:  # a tag header cut short by another tag: drop the fragment
                self._tag_error("a tag header was not closed with <|sep|>")
            self.header, self.header_kind = "", name
        elif name == SEP:
            if self.header is None:
                return
            header, kind = self.header, self.header_kind
            self.header = None
            self._k3_tag(kind == OPEN, header)
        # other specials (<|end_of_msg|>, [EOS], reserved ...) carry no text

    def _tag_error(self, reason: str) -> None:
        self.header = None
        if self.call is not None:
            self.call.error = self.call.error or reason

    def _k3_tag(self, is_open: bool, header: str) -> None:
        name, attrs = _parse_header(header)
        call = self.call
        if call is not None:
            self._k3_call_tag(call, is_open, name, attrs)
            return
        if is_open and name == "think":
            self.channel = "reasoning"
        elif is_open and name == "response":
            self.channel = "content"
        elif is_open and name == "tools":
            self.channel = "tools"
        elif is_open and name == "call" and self.channel == "tools":
            self.call = _Call(ids=list(self.header_ids), name=attrs.get("tool") if attrs else None)
            if not self.call.name:
                self.call.error = "the call has no tool attribute"
        elif not is_open and name in ("think", "response", "tools"):
            self.channel = "content"
        # any other tag (message wrappers, unknown names) is structure, not text

    def _k3_call_tag(self, call: _Call, is_open: bool, name: str | None, attrs: dict | None) -> None:
        if attrs is None:
            call.error = call.error or "a tag header does not parse"
        elif is_open and name == "argument" and call.arg_key is None and call.json_text is None:
            if "key" not in attrs or attrs.get("type") not in ("string", "number", "boolean", "null", "object", "array"):
                call.error = call.error or f"argument tag without key / valid type: {attrs}"
            call.arg_key, call.arg_type, call.arg_text = attrs.get("key", ""), attrs.get("type"), ""
        elif not is_open and name == "argument" and call.arg_key is not None:
            self._finish_argument(call)
        elif is_open and name == "json" and call.arg_key is None and call.args is None and call.json_text is None:
            call.json_text = ""
        elif not is_open and name == "json" and call.json_text is not None and not call.json_done:
            call.json_done = True
        elif not is_open and name == "call":
            self.call = None
            self._finish_call(call)
        else:
            call.error = call.error or f"unexpected tag {name!r} inside a call"

    def _finish_argument(self, call: _Call) -> None:
        key, kind, text = call.arg_key, call.arg_type, call.arg_text
        call.arg_key = None
        if call.error:
            return
        if kind == "string":
            value: Any = text
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                call.error = f"argument {key!r} of type {kind} is not JSON ({exc})"
                return
            if _argument_text(value)[0] != kind:
                call.error = f"argument {key!r}: {text!r} is not a {kind}"
                return
        if call.args is None:
            call.args = {}
        call.args[key] = value

    def _call_text(self, text: str) -> None:
        call = self.call
        if call.arg_key is not None:
            call.arg_text += text
        elif call.json_text is not None and not call.json_done:
            call.json_text += text
        elif self.family == "k2":
            call.header += text
        elif text.strip():
            call.error = call.error or f"text {text[:40]!r} outside the call's argument elements"

    def _finish_call(self, call: _Call) -> None:
        value: Any = call.args or {}
        if self.family == "k3" and call.json_text is not None and not call.error:
            try:
                value = json.loads(call.json_text)
            except json.JSONDecodeError as exc:
                call.error = f"json block is not JSON ({exc})"
            if not call.json_done:
                call.error = "json block not closed"
        if call.error or not self.tools_declared:
            self._fail(call, call.error or "no tools were declared")
            return
        if self.family == "k3":
            arguments = json.dumps(value, ensure_ascii=False)
            call_id = f"functions.{call.name}:{len(self.tool_calls)}"
        else:
            arguments, call_id = call.arg_text.strip(), call.call_id
        self.tool_calls.append({"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}})

    def _fail(self, call: _Call, reason: str) -> None:
        """An unparseable call: its tokens, decoded as the model wrote them, become content."""
        self.failures += 1
        self.failure_reasons.append(reason)
        self._emit_content(self.tok.decode(call.ids))

    # -- K2
    def _k2_special(self, name: str) -> None:
        call = self.call
        if call is not None:
            if name == CALL_ARGS and call.arg_key is None:
                call.call_id = call.header.strip()
                call.name = _k2_function_name(call.call_id)
                if call.name is None:
                    call.error = f"call id {call.call_id!r} is not functions.NAME:INDEX"
                call.arg_key, call.arg_text = "", ""
            elif name == CALL_END:
                self.call = None
                if call.arg_key is None:
                    call.error = call.error or "no argument marker"
                else:
                    try:
                        json.loads(call.arg_text)
                    except json.JSONDecodeError as exc:
                        call.error = call.error or f"arguments are not JSON ({exc})"
                self._finish_call(call)
            else:
                call.error = call.error or f"unexpected {name} inside a call"
                if name in (CALL_BEGIN, CALLS_END, IM_END):  # the call is over: the marker belongs outside it
                    call.ids.pop()
                    self.call = None
                    self._finish_call(call)
                    self._k2_special(name)
            return
        if name == THINK:
            self.channel = "reasoning"
        elif name == END_THINK:
            self.channel = "content"
        elif name == CALLS_BEGIN:
            self.channel = "tools"
        elif name == CALLS_END:
            self.channel = "content"
        elif name == CALL_BEGIN and self.channel == "tools":
            self.call = _Call(ids=[self.tok.encode_special(CALL_BEGIN)])
        # other specials carry no text


def _k2_function_name(call_id: str) -> str | None:
    """NAME of a K2 call id `functions.NAME:INDEX` (the part between the last '.' and the ':')."""
    m = re.fullmatch(r"(?:[^:\s]*\.)?([^.:\s]+):\d+", call_id)
    return m.group(1) if m else None


_ATTR_RE = re.compile(r'\s+([A-Za-z_][\w\-]*)="([^"]*)"')


def _parse_header(header: str) -> tuple[str | None, dict | None]:
    """`name key="value" ...` -> (name, {key: value}); (name, None) if the attributes do not parse."""
    m = re.match(r"([A-Za-z_][\w\-]*)", header)
    if not m:
        return None, None
    attrs: dict[str, str] = {}
    pos = m.end()
    for a in _ATTR_RE.finditer(header, pos):
        if a.start() != pos:
            return m.group(1), None
        attrs[a.group(1)] = _unescape(a.group(2))
        pos = a.end()
    return (m.group(1), attrs) if header[pos:].strip() == "" else (m.group(1), None)


def parse_output(tokenizer: Tokenizer, family: str, token_ids: list[int], *, starts_in_reasoning: bool, tools_declared: bool = True) -> ParsedMessage:
    """Parse a whole assistant output (the ids after the generation prompt)."""
    parser = OutputParser(tokenizer, family, starts_in_reasoning=starts_in_reasoning, tools_declared=tools_declared)
    parser.feed(token_ids)
    return parser.finish()

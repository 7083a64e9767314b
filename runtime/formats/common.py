"""What the chat formats share: rendered segments, request-option normalisation, message accessors, and the
renderer base class (message bodies with text and image parts, tool-result grouping)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moe_export.export.errors import InputError
from moe_export.runtime.formats.markers import FAMILIES

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt: a special-token name (`special`) or ordinary text."""

    text: str
    special: bool = False
    source: str | None = field(default=None, compare=False)  # an image marker's content part ("messages[0].content[1]")


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise InputError(f"chat family must be one of {', '.join(FAMILIES)}, got {family!r}")


def tool_choice_of(choice: str | dict | None) -> str | None:
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


def response_format_of(fmt: dict | None) -> dict | None:
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


def arguments_value(call: dict, where: str) -> Any:
    """A tool call's arguments as a JSON value (OpenAI sends a JSON string; a dict is accepted too)."""
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}.function.arguments is not valid JSON ({exc})") from None
    return args


def call_name(call: Any, where: str) -> str:
    name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}.function.name must be a non-empty string")
    return name


class Renderer:
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
            name = call_name(call, f"messages[{i}]") if call else messages[i].get("name")
            self.tool_result(messages[i], i, index, name)


def reasoning_of(msg: dict, where: str) -> str:
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise InputError(f"{where}.reasoning_content must be a string")
    return reasoning or ""


def tool_calls_of(msg: dict, where: str) -> list[dict]:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InputError(f"{where}.tool_calls must be a list of tool-call objects")
    return calls


def argument_text(value: Any) -> tuple[str, str]:
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


def sorted_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")

"""What the chat formats share: rendered segments and a renderer's output, message content (text and image
parts), JSON helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moe_export.common.errors import InputError

IMAGE_PART_TYPES = ("image", "image_url")  # OpenAI content-part types that are images (encoding_k3.py's list)


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt: a special-token name (`special`) or ordinary text. Each text segment is
    tokenized on its own (K3 encodes its renderer's pieces one by one; the K2 renderer and checkpoint templates
    emit the whole text between two markers as one segment, as tokenizing their rendered string does)."""

    text: str
    special: bool = False
    source: str | None = field(default=None, compare=False)  # an image marker's content part ("messages[0].content[1]")


@dataclass
class Rendered:
    """A rendered conversation: its segments, and where each assistant message lies in them
    ((message index, start, stop) into `segments`), and where the internal messages that follow the conversation
    begin (K3's tool-choice / response-format messages: a later turn's prompt has the next turn there instead;
    None when there are none)."""

    segments: list[Segment] = field(default_factory=list)
    assistant_spans: list[tuple[int, int, int]] = field(default_factory=list)
    trailer_start: int | None = None

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


def deep_sorted(value: Any) -> Any:
    """`value` with every object's keys sorted, at every level (lists keep their order)."""
    if isinstance(value, dict):
        return {k: deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InputError("messages must be a list of objects")


def check_tools(tools: Any) -> None:
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError("tools must be a list of tool objects")


def content_parts(content: Any, where: str, *, vision: bool) -> list[str | None]:
    """A message's content as a list of texts and images (None): a string is one text, None none, a list of
    parts each part's `text`, or None for an image part (`type` image / image_url). An image part is an
    InputError unless the engine has a vision graph."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string or a list of content parts")
    out: list[str | None] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            if not vision:
                raise InputError(f"{where}.content[{k}] is an image, but this engine has no vision graph (text only)")
            out.append(None)
        elif isinstance(kind, str) and "text" in part:
            out.append(str(part["text"]))
        else:
            raise InputError(f"{where}.content[{k}] must be a text part (with `text`) or an image part, got {part!r:.80}")
    return out

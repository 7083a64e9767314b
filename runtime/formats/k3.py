"""K3's XTML chat format: `<|open|>TAG attrs<|sep|> ... <|close|>TAG<|sep|>`, each message ended by
`<|end_of_msg|>`; assistant bodies hold think / response / tools elements."""

from __future__ import annotations

import json
from typing import Any

from moe_export.runtime.formats.common import (
    Renderer, Segment, argument_text, arguments_value, call_name, escape, reasoning_of, sorted_json, tool_calls_of,
)
from moe_export.runtime.formats.markers import CLOSE, END_OF_MSG, IMAGE, OPEN, SEP

TOOL_DECLARE_HEADER = "# Tools\n\nYou can call the following tools. Their definitions, in JSON:\n"
TOOL_CHOICE_TEXT = {
    "required": "You must call at least one of the declared tools in this turn.",
    "none": "Do not call any tool in this turn; answer directly.",
}


class K3Renderer(Renderer):
    """K3 XTML."""

    def image(self, where: str) -> None:
        self.out.append(Segment(IMAGE, special=True, source=where))

    def open_tag(self, name: str, *attrs: tuple[str, Any]) -> None:
        self.mark(OPEN)
        self.text(name + "".join(f' {k}="{escape(str(v))}"' for k, v in attrs))
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
            self.system("tool-declare", TOOL_DECLARE_HEADER + "```json\n" + sorted_json(tools) + "\n```")
        if self.thinking:
            self.system("thinking-effort", f"Thinking effort: {effort}.")
        if choice is not None:
            text = TOOL_CHOICE_TEXT.get(choice) or f"You must call the tool `{choice.split(':', 1)[1]}` in this turn."
            self.system("tool-choice", text)
        if fmt is not None:
            text = "Respond with one JSON object and nothing else."
            if fmt["type"] == "json_schema":
                text = "Respond with one JSON value that matches this JSON schema, and nothing else:\n```json\n" + sorted_json(fmt["schema"]) + "\n```"
            self.system("response-format", text)

    def plain(self, msg: dict, i: int, role: str) -> None:
        attrs = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
        self.open_tag("message", *attrs)
        self.body(msg.get("content"), f"messages[{i}]")
        self.end_message()

    def assistant(self, msg: dict, i: int) -> None:
        where = f"messages[{i}]"
        self.open_tag("message", ("role", "assistant"))
        reasoning = reasoning_of(msg, where)
        if self.thinking or reasoning:
            self.open_tag("think")
            self.text(reasoning)
            self.close_tag("think")
        self.open_tag("response")
        self.body(msg.get("content"), where)
        self.close_tag("response")
        calls = tool_calls_of(msg, where)
        if calls:
            self.open_tag("tools")
            for k, call in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                self.open_tag("call", ("tool", call_name(call, cw)), ("index", k + 1))
                args = arguments_value(call, cw)
                if isinstance(args, dict):
                    for key, value in args.items():
                        kind, text = argument_text(value)
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

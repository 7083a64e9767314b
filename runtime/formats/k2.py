"""K2 / Kimi Linear role-token chat format: `<|im_user|>user<|im_middle|>...<|im_end|>`, reasoning in
`<think>...</think>`, tool calls in `<|tool_calls_section_begin|>...` sections."""

from __future__ import annotations

import json

from moe_export.export.errors import InputError
from moe_export.runtime.formats.common import Renderer, call_name, reasoning_of, tool_calls_of
from moe_export.runtime.formats.markers import (
    CALL_ARGS, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, END_THINK, IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, THINK,
)

K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


class K2Renderer(Renderer):
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
        reasoning = reasoning_of(msg, where)
        if self.thinking or reasoning:
            self.mark(THINK)
            self.text(reasoning)
            self.mark(END_THINK)
        self.body(msg.get("content"), where)
        calls = tool_calls_of(msg, where)
        if calls:
            self.mark(CALLS_BEGIN)
            for k, call in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                name = call_name(call, cw)
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

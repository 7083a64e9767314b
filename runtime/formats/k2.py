"""K2 / Kimi Linear role-token chat format, as K2-Thinking's chat template renders it.

Specification: the vendor's `chat_template.jinja` of moonshotai/Kimi-K2-Thinking (public copy: ggml-org/llama.cpp
`models/templates/moonshotai-Kimi-K2-Thinking.jinja`, whose `tools | tojson()` is the vendor's
`tools | tojson(separators=(',', ':'))` there), rendered as transformers' `apply_chat_template` renders it:
keys whose value is None dropped from each message, `reasoning_content` filled from `thinking` / `reasoning`,
and the tools deep-sorted by key first (as the vendor's `tokenization_kimi.py` does).

  [<|im_system|>tool_declare<|im_middle|>TOOLS<|im_end|>]           tools as compact JSON
  [<|im_system|>system<|im_middle|>You are Kimi, ...<|im_end|>]     when the first message is not a system one
  <|im_user|>NAME<|im_middle|>CONTENT<|im_end|>                      NAME: the message's `name`, else its role;
  <|im_assistant|>NAME<|im_middle|><think>R</think>CONTENT[CALLS]<|im_end|>   other roles use <|im_system|>
  <|im_system|>NAME<|im_middle|>## Return of ID\\nCONTENT<|im_end|>   tool results, in the order given
  <|im_assistant|>assistant<|im_middle|>                             generation prompt (no <think>)

`continue_final_message` (transformers' option of that name, for prefilling the answer): the final message,
an assistant one, is left open for the model to continue: cut right after its content (no tool calls, no
`<|im_end|>`), with its think element as the template renders it. Unlike transformers' string search, an
empty content is cut in the same place (after `</think>`), and the option with add_generation_prompt is an
error, as there.

Past reasoning is dropped (`<think></think>`) for every message up to the last assistant message without tool
calls, and kept after it (the running agent loop). Calls:
`<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`
+ `<|tool_calls_section_end|>` (ARGS: the arguments string as given, or an object as JSON).
The text between two markers is one segment (tokenizing the rendered string splits it at the markers only).
"""

from __future__ import annotations

import json
from typing import Any

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import (
    CALL_ARGS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    END_THINK,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    THINK,
)
from moe_export.runtime.formats.common import (
    Rendered,
    Segment,
    check_messages,
    check_tools,
    compact_json,
    content_parts,
    deep_sorted,
)

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, first wins


class _Writer:
    def __init__(self) -> None:
        self.out = Rendered()

    def mark(self, name: str) -> None:
        self.out.segments.append(Segment(name, special=True))

    def text(self, text: Any) -> None:
        text = str(text)
        if not text:
            return
        segs = self.out.segments
        if segs and not segs[-1].special:
            segs[-1] = Segment(segs[-1].text + text)
        else:
            segs.append(Segment(text))

    def header(self, role: str, name: Any) -> None:
        self.mark(IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM)
        self.text(name)
        self.mark(IM_MIDDLE)

    def content(self, content: Any, where: str) -> None:
        for part in content_parts(content, where, vision=False):
            self.text(part)


def _normalized(msg: dict) -> dict:
    """The message as transformers hands it to the template: None values dropped, reasoning aliased."""
    msg = {k: v for k, v in msg.items() if v is not None}
    reasoning = next((msg[k] for k in REASONING_FIELDS if k in msg), None)
    return msg if reasoning is None else {**msg, "reasoning_content": reasoning}


def _calls(w: _Writer, calls: Any, where: str) -> None:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InputError(f"{where}.tool_calls must be a list of tool-call objects")
    w.mark(CALLS_BEGIN)
    for k, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or "arguments" not in fn:
            raise InputError(f"{where}.tool_calls[{k}].function.arguments is required")
        args = fn["arguments"]
        w.mark(CALL_BEGIN)
        w.text(call.get("id", ""))
        w.mark(CALL_ARGS)
        w.text(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        w.mark(CALL_END)
    w.mark(CALLS_END)


def render_k2(messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
              continue_final_message: bool = False) -> Rendered:
    """K2 segments of a conversation (OpenAI chat shape), exactly as the K2-Thinking template renders it."""
    check_messages(messages)
    check_tools(tools)
    msgs = [_normalized(m) for m in messages]
    for i, m in enumerate(msgs):
        if "role" not in m:
            raise InputError(f"messages[{i}] has no role")
    if continue_final_message:
        if add_generation_prompt:
            raise InputError("continue_final_message and add_generation_prompt cannot both be set")
        if not msgs or msgs[-1]["role"] != "assistant":
            raise InputError("continue_final_message needs the last message to be an assistant message")
    last_plain = max((i for i, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")), default=-1)
    w = _Writer()
    if tools:
        w.header("system", "tool_declare")
        w.text(compact_json(deep_sorted(tools)))
        w.mark(IM_END)
    if not msgs or msgs[0]["role"] != "system":
        w.header("system", "system")
        w.text(DEFAULT_SYSTEM)
        w.mark(IM_END)
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        start = len(w.out.segments)
        w.header(m["role"], m.get("name") or m["role"])
        if m["role"] == "assistant":
            w.mark(THINK)
            if i > last_plain:
                w.text(m.get("reasoning_content", ""))
            w.mark(END_THINK)
            w.content(m.get("content"), where)
            if continue_final_message and i == len(msgs) - 1:
                w.out.assistant_spans.append((i, start, len(w.out.segments)))
                return w.out
            if m.get("tool_calls"):
                _calls(w, m["tool_calls"], where)
        elif m["role"] == "tool":
            w.text(f"## Return of {m.get('tool_call_id', '')}\n")
            w.content(m.get("content"), where)
        else:
            w.content(m.get("content"), where)
        w.mark(IM_END)
        if m["role"] == "assistant":
            w.out.assistant_spans.append((i, start, len(w.out.segments)))
    if add_generation_prompt:
        w.header("assistant", "assistant")
    return w.out


def generation_prompt_segments() -> list[Segment]:
    w = _Writer()
    w.header("assistant", "assistant")
    return w.out.segments

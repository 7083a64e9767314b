"""K3's XTML chat format, as the vendor's renderer writes it.

Specification: `build_chat_segments` in `encoding_k3.py` (HF Kimi-K3 repository, vendored in vllm-project/vllm
as `vllm/tokenizers/encoding_k3.py`; conformance data from commit 2ec5134c, see tests/test_chat_conformance.py).
Every message is `<|open|>message role="R" ...<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`; a tag is opened
with `<|open|>` + name + ` key="value"` attributes (values escape `&` and `"`) + `<|sep|>` and closed with
`<|close|>` + name + `<|sep|>`. In order: the tool declaration (tools deep-sorted, compact JSON), the
thinking-effort message (thinking on), the conversation, the tool-choice (required / none) and response-format
(json_object / json_schema) messages, the generation prompt (`<|open|>message role="assistant"<|sep|>` +
`<|open|>think<|sep|>`, or `<|open|>response<|sep|>` with thinking off).

The segments are the vendor's: each text piece (a tag name, ` key`, `="`, a value, `"`, a body) is its own
segment and is tokenized alone, as the vendor's tokenizer does; markers and image placeholders are special.
Where the vendor raises, this raises InputError with the vendor's message. Deliberate differences: a
`developer` message renders as a system message (the vendor drops it), and a message with an unknown role,
or one that is not an object, is refused (the vendor skips it).
"""

from __future__ import annotations

import json
from typing import Any

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import CLOSE, END_OF_MSG, IMAGE, OPEN, SEP
from moe_export.runtime.formats.common import (
    Rendered,
    Segment,
    check_messages,
    check_tools,
    compact_json,
    content_parts,
    deep_sorted,
)

EFFORTS = ("low", "high", "max")  # the vendor's accepted thinking_effort values
DEFAULT_EFFORT = "max"

TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
TOOL_DECLARE_DYNAMIC = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n{}\n```"
)
THINKING_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
RESPONSE_FORMAT = {
    "json_object": "The system is invoked with `response_format=json_object`.\n" + RAW_JSON,
    "json_schema": "The system is invoked with `response_format=json_schema`.\n" + RAW_JSON
    + "\nThe JSON data must match the following schema:\n```json\n{}\n```",
}
UNRESOLVED_TOOL = ("Kimi K3 tool messages need a resolvable tool name: carry `tool`/`name`, or match a preceding "
                   "assistant tool_call by order.")


def check_effort(effort: str | None) -> None:
    if effort is not None and effort not in EFFORTS:
        raise InputError(f"Kimi K3 supports thinking_effort values: {', '.join(sorted(EFFORTS))}; got {effort!r}")


def xtml_type(value: Any) -> str:
    """The `type` attribute of an argument element."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def xtml_value(value: Any) -> str:
    """An argument element's text: a string raw, anything else as JSON (default separators)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def call_arguments(call: dict, where: str) -> tuple[dict, str | None]:
    """(argument object, raw json block text or None) of a tool call, as the vendor normalises them: absent or
    blank -> {}; an object; a string holding a JSON object -> that object; a string that is not JSON -> a raw
    `json type="object"` block; any other JSON or type -> error."""
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if not isinstance(args, str):
        raise InputError(f"{where}: Kimi K3 tool call arguments must be a dict or a JSON object string.")
    if not args.strip():
        return {}, None
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return {}, args
    if not isinstance(value, dict):
        raise InputError(f"{where}: Kimi K3 tool call arguments must be a JSON object.")
    return value, None


def _call_function(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise InputError(f"{where} must be a tool-call object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or "name" not in fn:
        raise InputError(f"{where}: Kimi K3 tool calls require a function name.")
    return fn


def _reorder_tool_results(messages: list[dict]) -> list[tuple[int, dict]]:
    """(original index, message) in rendering order: each run of tool messages whose ids all match calls of
    the latest assistant message is sorted into call order, each taking its call's function name as `tool`
    (and as `name` where it has one); a run with any unmatched id keeps its order."""
    out: list[tuple[int, dict]] = []
    calls: dict[str, tuple[int, Any]] = {}  # call id -> (1-based position, function name)
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg.get("role") == "assistant":
            calls = {}
            tool_calls = msg.get("tool_calls")
            for pos, call in enumerate(tool_calls if isinstance(tool_calls, list) else [], start=1):
                if isinstance(call, dict) and call.get("id") is not None and str(call["id"]) not in calls:
                    fn = call.get("function")
                    calls[str(call["id"])] = (pos, fn.get("name") if isinstance(fn, dict) else call.get("name"))
        if msg.get("role") != "tool":
            out.append((i, msg))
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((i, messages[i], calls.get(str(call_id)) if call_id is not None else None))
            i += 1
        if any(match is None for _, _, match in run):
            out += [(j, m) for j, m, _ in run]
            continue
        for j, m, (_, name) in sorted(run, key=lambda r: (r[2][0], r[0])):
            if name is not None:
                m = {**m, "tool": name, **({"name": name} if "name" in m else {})}
            out.append((j, m))
    return out


def response_schema(response_format: Any) -> Any:
    """The schema of a json_schema response format, found where the vendor looks for it."""
    wrapper = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if isinstance(wrapper, dict):
        return wrapper.get("schema", wrapper.get("json_schema", wrapper))
    return wrapper


class _Writer:
    def __init__(self, vision: bool) -> None:
        self.vision = vision
        self.out = Rendered()

    def mark(self, name: str) -> None:
        self.out.segments.append(Segment(name, special=True))

    def text(self, text: Any) -> None:
        text = str(text)
        if text:
            self.out.segments.append(Segment(text))

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        self.mark(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape(value))
            self.text('"')
        self.mark(SEP)

    def close(self, tag: str) -> None:
        self.mark(CLOSE)
        self.text(tag)
        self.mark(SEP)

    def message(self, attrs: list[tuple[str, Any]], body) -> None:
        self.open("message", *attrs)
        body()
        self.close("message")
        self.mark(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        self.message([("role", "system"), ("type", kind)], lambda: self.text(body.strip()))

    def tool_declare(self, tools: Any, template: str) -> None:
        self.message([("role", "system"), ("type", "tool-declare")], lambda: self.text(template.format(compact_json(tools))))

    def content(self, content: Any, where: str) -> None:
        for k, part in enumerate(content_parts(content, where, vision=self.vision)):
            if part is None:  # an image part (content is a list: part k is content[k])
                self.out.segments.append(Segment(IMAGE, special=True, source=f"{where}.content[{k}]"))
            else:
                self.text(part)

    def assistant(self, msg: dict, where: str, thinking: bool) -> None:
        if thinking:
            self.open("think")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning is not None and str(reasoning).strip():
                self.text(reasoning)
            self.close("think")
        self.open("response")
        self.content(msg.get("content"), where)
        self.close("response")
        calls = msg.get("tool_calls")
        if not calls:
            return
        if not isinstance(calls, list):
            raise InputError(f"{where}.tool_calls must be a list of tool-call objects")
        self.open("tools")
        for k, call in enumerate(calls, start=1):
            cw = f"{where}.tool_calls[{k - 1}]"
            fn = _call_function(call, cw)
            args, block = call_arguments(call, cw)
            self.open("call", ("tool", fn["name"]), ("index", k))
            if block is not None:
                self.open("json", ("type", "object"))
                self.text(block)
                self.close("json")
            else:
                for key, value in args.items():
                    self.open("argument", ("key", key), ("type", xtml_type(value)))
                    self.text(xtml_value(value))
                    self.close("argument")
            self.close("call")
        self.close("tools")


def render_k3(
    messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = True, thinking_effort: str | None = None,
    tool_choice: Any = None, response_format: Any = None, add_generation_prompt: bool = True, vision: bool = False,
) -> Rendered:
    """K3 segments of a conversation (OpenAI chat shape), exactly as `build_chat_segments` writes them."""
    check_messages(messages)
    check_tools(tools)
    check_effort(thinking_effort)
    effort = thinking_effort or DEFAULT_EFFORT
    w = _Writer(vision)
    if tools:
        w.tool_declare(deep_sorted(tools), TOOL_DECLARE)
    if thinking:
        w.system("thinking-effort", THINKING_EFFORT.format(effort))
    calls: Any = None
    tool_index = 0
    for i, msg in _reorder_tool_results(messages):
        where = f"messages[{i}]"
        if "role" not in msg:
            raise InputError(f"{where} has no role")
        role = "system" if msg["role"] == "developer" else msg["role"]
        named = [("name", msg["name"])] if msg.get("name") else []
        if role == "user":
            w.message([("role", "user"), *named], lambda msg=msg, where=where: w.content(msg.get("content"), where))
        elif role == "system" and msg.get("tools"):
            w.tool_declare(deep_sorted(msg["tools"]), TOOL_DECLARE_DYNAMIC)
        elif role == "system":
            w.message([("role", "system"), *named], lambda msg=msg, where=where: w.content(msg.get("content"), where))
        elif role == "tool":
            tool_index += 1
            name = msg.get("tool", msg.get("name"))
            if name is None and isinstance(calls, list) and tool_index <= len(calls):
                name = _call_function(calls[tool_index - 1], f"tool_calls[{tool_index - 1}]")["name"]
            if name is None:
                raise InputError(f"{where}: {UNRESOLVED_TOOL}")
            w.message([("role", "tool"), ("tool", name), ("index", tool_index)], lambda msg=msg, where=where: w.content(msg.get("content"), where))
        elif role == "assistant":
            calls, tool_index = msg.get("tool_calls"), 0
            start = len(w.out.segments)
            w.message([("role", "assistant"), *named], lambda msg=msg, where=where: w.assistant(msg, where, thinking))
            w.out.assistant_spans.append((i, start, len(w.out.segments)))
        else:
            raise InputError(f"{where}.role must be system, developer, user, assistant or tool, got {role!r}")
    conversation_end = len(w.out.segments)
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE:
        w.system("tool-choice", TOOL_CHOICE[tool_choice])
    kind = response_format.get("type", response_format) if isinstance(response_format, dict) else response_format
    if kind == "json_object":
        w.system("response-format", RESPONSE_FORMAT["json_object"])
    elif kind == "json_schema":
        w.system("response-format", RESPONSE_FORMAT["json_schema"].format(compact_json(deep_sorted(response_schema(response_format)))))
    if len(w.out.segments) > conversation_end:
        w.out.trailer_start = conversation_end
    if add_generation_prompt:
        generation_prompt(w, thinking)
    return w.out


def generation_prompt(w: _Writer, thinking: bool) -> None:
    w.open("message", ("role", "assistant"))
    w.open("think" if thinking else "response")


def generation_prompt_segments(thinking: bool) -> list[Segment]:
    w = _Writer(False)
    generation_prompt(w, thinking)
    return w.out.segments

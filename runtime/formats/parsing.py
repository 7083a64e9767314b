"""Parsing model output back into an assistant message, whole or streaming, for both Kimi families.

Parsing works on token ids: markers are special tokens, so the parser knows a marker from text that
merely looks like one (a `<|im_end|>` or `</think>` the model spelled with ordinary tokens is text, where
vLLM's text-based parsers would take it for a marker). Streaming (`OutputParser.feed`) returns the new
reasoning / content text and tool-call pieces in output order (`ParsedDelta`); a tag header (`<|open|>think`
before its `<|sep|>`) and an incomplete UTF-8 character are held back until complete. `finish()` returns
the message, tool calls in OpenAI shape (`arguments` a JSON string).

Tool calls stream as they are generated (`ToolCallDelta`): a call opens once its function name is read (K3:
its `<|open|>call tool="NAME"` tag; K2: its id, at the argument marker), with the id the message will carry;
then its arguments text arrives in fragments, then it ends. The fragments of a call that ends "done" add up
to its `arguments` exactly: K3 argument elements are written out as a JSON object as they arrive (a string
value's text escaped as it comes; a value of any other type when its element closes, since it is read as
JSON only then), a `json` block's text as written; K2's arguments without surrounding whitespace (held back
until text follows it). A call that opened and then does not parse (or that the output ends inside) ends
"failed": it is not among the message's tool calls, and what the message says of it (its text as content,
or nothing when cut short) follows in the stream as for a whole parse.

Behaviours, aligned with vLLM's Kimi K2 / K3 reasoning and tool parsers where they are right:
  - Where the output starts (`starts_in_reasoning`, see `chat.output_starts_in_reasoning`): K3 with
    thinking on, after the generation prompt's `<|open|>think<|sep|>`; K2 with thinking on, in reasoning
    too, as vLLM's kimi_k2 parser reads it (K2-Thinking's generation prompt has no `<think>`: the model
    may write one, which is consumed, or start reasoning at once). Reasoning ends at `</think>` or at
    `<|tool_calls_section_begin|>` (K2), at `<|close|>think<|sep|>` (K3); `R</think>answer` splits.
  - The tool section ends the message: text after `<|tool_calls_section_end|>` / `<|close|>tools<|sep|>`
    is dropped (vLLM keeps its parser in the tool state there); further calls are still read.
  - K2 arguments are the text between `<|tool_call_argument_begin|>` and `<|tool_call_end|>` without
    surrounding whitespace; empty arguments are `{}`.
  - K3 argument elements are typed leniently, as vLLM does: `type="string"` (or no type) is the raw text;
    any other type is the text read as JSON whatever JSON type it turns out to be, or the raw text as a
    string when it is not JSON. A mismatch never fails the call. A `json` block carries the arguments
    text as written (K3 renders non-object arguments that way).
  - A tool call cut short (the output ended inside it, e.g. at max_tokens) and any tool call when the
    request declared no tools are dropped: no markup reaches content; each counts in
    `tool_call_parse_failures` (`failure_reasons` says why, for logs).
  - A finished call that does not parse (a K2 call id that is not `functions.NAME:INDEX`, a marker out of
    place, a K3 argument without a key or not closed) becomes content as the model wrote it, so the client
    sees what came out; it counts as a failure too.
  - A K3 key given twice stays twice in the arguments text (JSON readers keep the last value).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import (
    CALL_ARGS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    CLOSE,
    END_THINK,
    FAMILIES,
    IM_END,
    OPEN,
    SEP,
    THINK,
)
from moe_export.runtime.formats.k3 import unescape

if TYPE_CHECKING:
    from moe_export.runtime.tokenizer import Tokenizer

@dataclass
class ToolCallDelta:
    """A piece of a tool call as the output streams. index: the call's place among the calls this output opened
    (from 0; a failed call keeps its place, so after one the message's tool_calls are numbered apart); id, name:
    set on the piece that opens the call (the id the message gives it); arguments: text to append to the call's
    arguments; end: None while the call goes on, "done" (it is one of the message's tool calls, its arguments
    the fragments joined) or "failed" (it is not: it did not parse, or the output ended inside it)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    end: str | None = None


@dataclass
class ParsedDelta:
    """New output of one or more `feed` calls, in output order: parts are ("reasoning" | "content", text) and
    ("tool_call", ToolCallDelta); adjacent text of one channel, and adjacent pieces of one open call, joined.
    `reasoning` / `content`: the text by channel."""

    parts: list[tuple[str, str | ToolCallDelta]] = field(default_factory=list)

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.parts if k == "reasoning")

    @property
    def content(self) -> str:
        return "".join(v for k, v in self.parts if k == "content")

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        return [v for k, v in self.parts if k == "tool_call"]

    def add_text(self, channel: str, text: str) -> None:
        if not text:
            return
        if self.parts and self.parts[-1][0] == channel:
            self.parts[-1] = (channel, self.parts[-1][1] + text)
        else:
            self.parts.append((channel, text))

    def add_call(self, piece: ToolCallDelta) -> None:
        last = self.parts[-1][1] if self.parts and self.parts[-1][0] == "tool_call" else None
        if last is not None and last.index == piece.index and last.end is None and piece.id is None:
            last.arguments += piece.arguments
            last.end = piece.end
        else:
            self.parts.append(("tool_call", ToolCallDelta(piece.index, piece.id, piece.name, piece.arguments, piece.end)))

    def add(self, other: ParsedDelta) -> None:
        """Append `other` (which follows this delta in the output)."""
        for kind, value in other.parts:
            if kind == "tool_call":
                self.add_call(value)
            else:
                self.add_text(kind, value)


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
    index: int | None = None  # its ToolCallDelta index once opened in the stream
    arguments: str = ""  # the arguments text streamed so far
    held: str = ""  # K2: whitespace held back (streamed only when more text follows it)


class OutputParser:
    """Streaming parser of one assistant output (token ids after the generation prompt).

    feed(ids) -> ParsedDelta of new reasoning / content text and tool-call pieces; finish() -> ParsedMessage.
    After finish(), `delta` holds what finish() itself added (a held-back character, the end of an unfinished
    tool call): stream it as the last delta. first_call_index: K3 numbers a turn's calls `functions.NAME:i` from it (the calls of the
    conversation's earlier turns, so ids stay unique across turns; K2's model writes its own ids), counting every
    call it opens, a failed one included (so that no two calls of a stream share an id)."""

    def __init__(self, tokenizer: Tokenizer, family: str, *, starts_in_reasoning: bool, tools_declared: bool = True,
                 first_call_index: int = 0) -> None:
        if family not in FAMILIES:
            raise InputError(f"chat family must be one of {', '.join(FAMILIES)}, got {family!r}")
        self.tok = tokenizer
        self.family = family
        self.tools_declared = tools_declared
        self.first_call_index = first_call_index
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
        self.opened = 0  # tool calls opened in the stream
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
            self.delta.add_text("reasoning", text)
        elif self.channel == "content":
            self._emit_content(text)
        # text between calls inside a tool section is dropped (it is not part of any message field)

    def _emit_content(self, text: str) -> None:
        self.content.append(text)
        self.delta.add_text("content", text)

    # -- tool calls as they stream
    def _open(self, call: _Call, call_id: str) -> None:
        """Open `call` in the stream (its function name is known; `call_id` is the id the message gives it)."""
        call.call_id, call.index = call_id, self.opened
        self.opened += 1
        self.delta.add_call(ToolCallDelta(call.index, id=call_id, name=call.name))

    def _args(self, call: _Call, text: str) -> None:
        """Append `text` to the call's arguments (streamed when the call is open); nothing once it has failed."""
        if not text or call.error:
            return
        call.arguments += text
        if call.index is not None:
            self.delta.add_call(ToolCallDelta(call.index, arguments=text))

    def _end(self, call: _Call, end: str) -> None:
        if call.index is not None:
            self.delta.add_call(ToolCallDelta(call.index, end=end))

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
        """End of output: flush, drop an unfinished tool call, return the message."""
        self.delta = ParsedDelta()
        self._emit(self.run.flush())
        self.header = None  # an unfinished tag header is a marker fragment: never content
        if self.call is not None:
            self._drop(self.call, "the output ended inside the call")
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
        if self.channel == "tools":  # the tool section ends the message: only further calls are read
            if is_open and name == "call":
                self._k3_open_call(attrs)
            return
        if is_open and name == "think":
            self.channel = "reasoning"
        elif is_open and name == "response":
            self.channel = "content"
        elif is_open and name == "tools":
            self.channel = "tools"
        elif not is_open and name in ("think", "response"):
            self.channel = "content"
        # any other tag (message wrappers, unknown names) is structure, not text

    def _k3_open_call(self, attrs: dict | None) -> None:
        self.call = _Call(ids=list(self.header_ids), name=attrs.get("tool") if attrs else None)
        if not self.call.name:
            self.call.error = "the call has no tool attribute"
        elif self.tools_declared:  # (a call when no tools were declared is dropped: never streamed)
            self._open(self.call, f"functions.{self.call.name}:{self.first_call_index + self.opened}")

    def _k3_call_tag(self, call: _Call, is_open: bool, name: str | None, attrs: dict | None) -> None:
        if attrs is None:
            call.error = call.error or "a tag header does not parse"
        elif is_open and name == "argument" and call.arg_key is None and call.json_text is None:
            if "key" not in attrs:
                call.error = call.error or f"argument tag without a key: {attrs}"
            call.arg_key, call.arg_type, call.arg_text = attrs.get("key", ""), attrs.get("type", "string"), ""
            opening = "{" if call.args is None else ", "
            self._args(call, opening + json.dumps(call.arg_key, ensure_ascii=False) + ": " + ('"' if call.arg_type == "string" else ""))
        elif not is_open and name == "argument" and call.arg_key is not None:
            self._finish_argument(call)
        elif is_open and name == "json" and call.arg_key is None and call.args is None and call.json_text is None:
            call.json_text = ""
        elif not is_open and name == "json" and call.json_text is not None and not call.json_done:
            call.json_done = True
        elif not is_open and name == "call":
            if call.arg_key is not None:
                call.error = call.error or f"argument {call.arg_key!r} was not closed"
            self.call = None
            self._finish_call(call)
        else:
            call.error = call.error or f"unexpected tag {name!r} inside a call"

    def _finish_argument(self, call: _Call) -> None:
        key, kind, text = call.arg_key, call.arg_type, call.arg_text
        call.arg_key = None
        if call.error:
            return
        value: Any = text
        if kind != "string":  # lenient, as vLLM: the JSON value whatever its type, else the raw text
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                pass
        if call.args is None:
            call.args = {}
        call.args[key] = value
        # a string's text was streamed as it came (escaped); any other value is known only now
        self._args(call, '"' if kind == "string" else json.dumps(value, ensure_ascii=False))

    def _call_text(self, text: str) -> None:
        call = self.call
        if call.arg_key is not None:
            call.arg_text += text
            if self.family == "k2":
                self._k2_arguments(call, text)
            elif call.arg_type == "string":  # escaped piece by piece as json.dumps escapes the whole (per character)
                self._args(call, json.dumps(text, ensure_ascii=False)[1:-1])
        elif call.json_text is not None and not call.json_done:
            call.json_text += text
            self._args(call, text)
        elif self.family == "k2":
            call.header += text
        elif text.strip():
            call.error = call.error or f"text {text[:40]!r} outside the call's argument elements"

    def _finish_call(self, call: _Call) -> None:
        if self.family == "k3" and call.json_text is not None and not call.json_done:
            call.error = call.error or "json block not closed"
        if not self.tools_declared:
            self._drop(call, "a tool call, but the request declared no tools")
            return
        if call.error:
            self._fail(call, call.error)
            return
        # the arguments are what streamed: a json block's text as written (K3 renders arguments that are not a
        # JSON object string that way); K3 argument elements written out as a JSON object (`{"k": v, ...}`, as
        # json.dumps writes a dict); K2's text stripped; no arguments at all: {}
        if self.family == "k3" and call.json_text is None:
            self._args(call, "{}" if call.args is None else "}")
        elif self.family == "k2" and not call.arguments:
            self._args(call, "{}")
        self.tool_calls.append({"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
        self._end(call, "done")

    def _fail(self, call: _Call, reason: str) -> None:
        """A finished call that does not parse: its tokens, decoded as the model wrote them, become content."""
        self._drop(call, reason)
        self._emit_content(self.tok.decode(call.ids))

    def _drop(self, call: _Call, reason: str) -> None:
        """A call that is not returned: counted, with its reason; ended "failed" in the stream if it opened there."""
        self.failures += 1
        self.failure_reasons.append(reason)
        self._end(call, "failed")

    # -- K2
    def _k2_special(self, name: str) -> None:
        call = self.call
        if call is not None:
            if name == CALL_ARGS and call.arg_key is None:
                call.call_id = call.header.strip()
                call.name = _k2_function_name(call.call_id)
                if call.name is None:
                    call.error = f"call id {call.call_id!r} is not functions.NAME:INDEX"
                elif self.tools_declared:
                    self._open(call, call.call_id)
                call.arg_key, call.arg_text = "", ""
            elif name == CALL_END:
                self.call = None
                if call.arg_key is None:  # the arguments are kept as written (K2 renders them verbatim)
                    call.error = call.error or "no argument marker"
                self._finish_call(call)
            else:
                call.error = call.error or f"unexpected {name} inside a call"
                if name in (CALL_BEGIN, CALLS_END, IM_END):  # the call is over: the marker belongs outside it
                    call.ids.pop()
                    self.call = None
                    self._finish_call(call)
                    self._k2_special(name)
            return
        if name == CALL_BEGIN and self.channel == "tools":
            self.call = _Call(ids=[self.tok.encode_special(CALL_BEGIN)])
        elif self.channel == "tools":  # the tool section ends the message (after its end marker too)
            return
        elif name == THINK:
            self.channel = "reasoning"
        elif name == END_THINK:
            self.channel = "content"
        elif name == CALLS_BEGIN:
            self.channel = "tools"
        # other specials carry no text


    def _k2_arguments(self, call: _Call, text: str) -> None:
        """Stream K2 argument text without its surrounding whitespace: leading whitespace dropped, whitespace
        held until text follows it."""
        text = call.held + text
        if not call.arguments:
            text = text.lstrip()
        body = text.rstrip()
        call.held = text[len(body):]
        self._args(call, body)


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
        attrs[a.group(1)] = unescape(a.group(2))
        pos = a.end()
    return (m.group(1), attrs) if header[pos:].strip() == "" else (m.group(1), None)


def parse_output(tokenizer: Tokenizer, family: str, token_ids: list[int], *, starts_in_reasoning: bool, tools_declared: bool = True) -> ParsedMessage:
    """Parse a whole assistant output (the ids after the generation prompt)."""
    parser = OutputParser(tokenizer, family, starts_in_reasoning=starts_in_reasoning, tools_declared=tools_declared)
    parser.feed(token_ids)
    return parser.finish()

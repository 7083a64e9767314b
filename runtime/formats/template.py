"""A checkpoint's own Jinja chat template, rendered as transformers' `apply_chat_template` renders it.

Where it comes from: `chat_template.jinja` beside the tokenizer, else `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates: `tool_use` when tools are given and it
exists, else `default`). The build copies both files into the engine directory, so every entry point that
loads the engine's tokenizer renders with it. Python shipped in a checkpoint is never executed; the template
runs in Jinja's immutable sandbox, configured as transformers configures it: trim_blocks, lstrip_blocks,
loop controls, a `{% generation %}` block (rendered as its body), `tojson` with transformers' arguments
(non-ASCII kept), `raise_exception`, `strftime_now`, and namespaces that refuse `_`-prefixed attributes.

What the template sees, as in transformers: `messages` (keys whose value is None dropped, `reasoning_content`
filled from `thinking` / `reasoning`), `tools` (for Kimi tokenizers deep-sorted by key first, as the vendor's
`tokenization_kimi.py` does before rendering), `documents` (None), `add_generation_prompt`, and the tokenizer
config's special tokens (`bos_token`, `eos_token`, ...).

Token ids: special-token strings in the caller's strings (message fields, tools) are marked before rendering
(private-use characters around them), so after rendering the text splits into the template's own markers
(special tokens) and text; the caller's copies of marker strings stay text (transformers'
`sanitize_control_tokens` does the same). A private-use marker character already in the caller's text is
dropped.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import TOKENIZER_CONFIG
from moe_export.runtime.formats.common import (
    Rendered,
    Segment,
    check_messages,
    check_tools,
    deep_sorted,
)

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MARK_START, MARK_END = "\ue000", "\ue001"  # around a caller's copy of a special-token string


class ChatTemplate:
    """A Jinja chat template with the tokenizer-config values it renders with.

    source: the template text, or {name: text} for named templates. origin: where it was read (for
    `inspect` and errors). sort_tools: deep-sort the tools first (Kimi tokenizers)."""

    def __init__(self, source: str | dict[str, str], origin: str, special_tokens: dict[str, str], *, sort_tools: bool) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = special_tokens
        self.sort_tools = sort_tools

    def text_for(self, tools: list[dict] | None) -> str:
        if isinstance(self.source, str):
            return self.source
        if tools is not None and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise InputError(f"{self.origin}: the named chat templates {sorted(self.source)} have no `default`")

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               special_tokens: tuple[str, ...] = ()) -> Rendered:
        """Render `messages`; `special_tokens`: the tokenizer's special-token strings (the split into markers
        and text), empty for text only."""
        check_messages(messages)
        check_tools(tools)
        source = self.text_for(tools)
        msgs = [_normalized(m) for m in messages]
        if tools is not None and self.sort_tools:
            tools = deep_sorted(tools)
        pattern = _token_pattern(tuple(sorted(special_tokens, key=len, reverse=True)))
        if pattern is not None:
            msgs, tools = _marked(msgs, pattern), _marked(tools, pattern)
        try:
            text = _compiled(source).render(
                messages=msgs, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # the template's raise_exception, an undefined access, a sandbox refusal ...
            raise InputError(f"{self.origin}: the chat template failed: {type(exc).__name__}: {exc}") from None
        return Rendered(_segments(text, pattern))


def _normalized(msg: dict) -> dict:
    msg = {k: v for k, v in msg.items() if v is not None}
    reasoning = next((msg[k] for k in REASONING_FIELDS if k in msg), None)
    return msg if reasoning is None else {"thinking": reasoning, **msg, "reasoning_content": reasoning}


@lru_cache(maxsize=64)
def _token_pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _marked(value: Any, pattern: re.Pattern) -> Any:
    """`value` with every special-token string inside its strings wrapped in the marker characters."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, value)
    if isinstance(value, dict):
        return {k: _marked(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, pattern) for v in value]
    return value


def _segments(text: str, pattern: re.Pattern | None) -> list[Segment]:
    """The rendered text as segments: the template's special-token strings as markers, marked copies of them
    as text of their own, the rest as text between (a lone marker character, left by a template that split
    a marked string, is dropped and ends a text segment)."""
    if pattern is None:
        return [Segment(text)] if text else []
    out: list[Segment] = []
    marked = re.compile(f"{MARK_START}({pattern.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
    pos = 0
    for m in marked.finditer(text):
        out += _split_markers(text[pos:m.start()], pattern)
        if m.group(1):
            out.append(Segment(m.group(1)))
        pos = m.end()
    return out + _split_markers(text[pos:], pattern)


def _split_markers(text: str, pattern: re.Pattern) -> list[Segment]:
    out: list[Segment] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append(Segment(text[pos:m.start()]))
        out.append(Segment(m.group(0), special=True))
        pos = m.end()
    if pos < len(text):
        out.append(Segment(text[pos:]))
    return out


@lru_cache(maxsize=8)
def _compiled(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask block): its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing `_`-prefixed attribute names (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InputError(f"the chat template does not parse: {exc} (line {exc.lineno})") from None


def load_chat_template(directory: Path, config: dict, *, sort_tools: bool) -> ChatTemplate | None:
    """The checkpoint's chat template (`chat_template.jinja`, else `chat_template` in its tokenizer config), or
    None when it ships none."""
    specials = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    path = directory / TEMPLATE_FILE
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials, sort_tools=sort_tools)
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text ({exc})") from None
    source = config.get("chat_template")
    origin = f"{directory / TOKENIZER_CONFIG}: chat_template"
    if source is None:
        return None
    if isinstance(source, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in source):
        source = {t["name"]: t["template"] for t in source}
    elif not isinstance(source, str):
        raise InputError(f"{origin} must be a string or a list of {{name, template}} objects")
    return ChatTemplate(source, origin, specials, sort_tools=sort_tools)

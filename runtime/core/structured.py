"""Grammar-constrained decoding with xgrammar: forced tool calls and JSON response formats.

The grammar covers the whole assistant turn in the family's own output format, reasoning included: the
model reasons freely (the thinking budget still closes the block), then the part after reasoning is
constrained. K3 (XTML): a forced/required call is an empty response block then the tools block, one
argument element per parameter with string values exactly as the parser reads them (raw text); a JSON
format is the response block's body. K2: xgrammar's builtin Kimi tag (tool-calls section with JSON
arguments), or the JSON answer after `</think>`. The reasoning block is xgrammar's builtin one.

The markers are special tokens: xgrammar matches them as text, so ordinary tokens that could spell one
from pieces (any token containing a marker's first two characters, or ending with its first character)
are also masked; a marker is then always emitted as its own token and the output parses by token id.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

from moe_export.export.errors import InputError
from moe_export.runtime.formats.markers import (
    CALL_ARGS, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, CLOSE, END_THINK, OPEN, SEP, THINK,
)

K3_MARKERS = (OPEN, CLOSE, SEP)
K2_MARKERS = (THINK, END_THINK, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)
FAMILY_MARKERS = {"k3": K3_MARKERS, "k2": K2_MARKERS}
XGRAMMAR_MODEL = {"k3": "kimi_k3", "k2": "kimi"}
K3_RESPONSE_BEGIN, K3_RESPONSE_END, K3_MESSAGE_END = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}", f"{CLOSE}message{SEP}"
CALL_INDEX_PATTERN = "[1-9][0-9]?"  # K2 / K3 call index: 1-based position of the call
JSON_MAX_WHITESPACE = 1  # consecutive whitespace characters allowed inside constrained JSON / arguments


class GrammarVocab:
    """The tokenizer as xgrammar sees it, plus the mask of ordinary tokens that could spell a marker.

    vocab_size: the model's logits width (>= the tokenizer's); ids past the tokenizer are never allowed."""

    def __init__(self, tokenizer, family: str, vocab_size: int) -> None:
        if family not in FAMILY_MARKERS:
            raise InputError(f"structured output needs a Kimi chat family (k3 or k2), this engine's is {family!r}")
        markers = FAMILY_MARKERS[family]
        marker_ids = {tokenizer.token_to_id(m) for m in markers}
        if None in marker_ids:
            raise InputError(f"the tokenizer lacks the {family} markers {markers} needed for structured output")
        encoded: list[bytes] = []
        self.spells_marker = torch.zeros(vocab_size, dtype=torch.bool)
        starts = {m[:2].encode() for m in markers}
        ends = {m[:1].encode() for m in markers}
        for i in range(tokenizer.vocab_size):
            text = tokenizer.decode([i])
            if tokenizer.decode([i], skip_special_tokens=True) == "" and text:
                encoded.append(text.encode() if i in marker_ids else b"")  # other specials: never emitted here
                continue
            piece = text.encode()
            encoded.append(piece)
            if any(s in piece for s in starts) or any(piece.endswith(e) for e in ends):
                self.spells_marker[i] = True
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def _compile_uncached(self, tag_json: str) -> xgr.CompiledGrammar:
        return self.compiler.compile_structural_tag(tag_json)

    def compile(self, tag: st.StructuralTag) -> xgr.CompiledGrammar:
        with self._lock:
            return self._compile(tag.model_dump_json())


def reasoning_mode(family: str, thinking: bool, starts_in_reasoning: bool) -> str:
    """xgrammar's reasoning mode: 'enabled' when the generation prompt opened the think block, 'auto'
    when the model may open it itself (K2), 'disabled' when thinking is off."""
    if not thinking:
        return "disabled"
    return "enabled" if starts_in_reasoning else "auto"


def _tools_tag(family: str, tools: list[dict], tool_choice, mode: str, parallel: bool) -> st.StructuralTag:
    index = "1" if isinstance(tool_choice, dict) or not parallel else CALL_INDEX_PATTERN
    if family == "k3":
        return _k3_tools_tag(tools, tool_choice, mode, parallel, index)
    choice = tool_choice if isinstance(tool_choice, str) else {"type": "function", "function": dict(tool_choice["function"])}
    try:
        tag = xgr.get_model_structural_tag(
            XGRAMMAR_MODEL[family], tools=tools, tool_choice=choice, reasoning=mode, parallel_tool_calls=parallel,
            max_whitespace_cnt=JSON_MAX_WHITESPACE,
        )
    except (ValueError, TypeError) as exc:
        raise InputError(f"tools: cannot build a tool-call grammar ({exc})") from None
    return _bounded_call_index(tag, index)


def _k3_argument_value(key: str, schema: dict, where: str) -> tuple[str, object]:
    """(XTML type attribute, value format) of one K3 argument element. Strings are raw text (exactly the
    value: an enum or const is matched literally, a pattern as a regex, otherwise any text without
    markers); other types are JSON values of their schema."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and all(isinstance(v, str) for v in schema.get("enum", [None]))):
        if "const" in schema:
            return "string", st.ConstStringFormat(value=str(schema["const"]))
        if schema.get("enum"):
            return "string", st.OrFormat(elements=[st.ConstStringFormat(value=v) for v in schema["enum"]])
        if schema.get("pattern"):
            return "string", st.RegexFormat(pattern=schema["pattern"])
        return "string", st.AnyTextFormat(excludes=list(K3_MARKERS))
    xtml = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "object": "object",
            "array": "array"}.get(kind)
    if xtml is None:
        raise InputError(f"{where}: parameter {key!r} needs one JSON `type` for grammar-constrained calls, got {kind!r}")
    return xtml, st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)


def _k3_call_tag(tool: dict, index_pattern: str) -> st.TagFormat:
    """`<|open|>call tool="NAME" index="I"<|sep|>` + one argument element per parameter (required ones
    always, optional ones optionally, in schema order) + `<|close|>call<|sep|>`."""
    fn = tool["function"]
    where = f"tool {fn['name']!r}"
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":
        raise InputError(f"{where}: parameters must be an object schema for grammar-constrained calls")
    required = set(params.get("required", []))
    elements: list = [st.RegexFormat(pattern=index_pattern), st.ConstStringFormat(value='"' + SEP)]
    for key, schema in (params.get("properties") or {}).items():
        kind, value = _k3_argument_value(key, schema if isinstance(schema, dict) else {}, where)
        attr_key = key.replace("&", "&amp;").replace('"', "&quot;")
        arg = st.TagFormat(begin=f'{OPEN}argument key="{attr_key}" type="{kind}"{SEP}', content=value,
                           end=f"{CLOSE}argument{SEP}")
        elements.append(arg if key in required else st.OptionalFormat(content=arg))
    return st.TagFormat(begin=f'{OPEN}call tool="{fn["name"]}" index="', content=st.SequenceFormat(elements=elements),
                        end=f"{CLOSE}call{SEP}")


def _k3_tools_tag(tools: list[dict], tool_choice, mode: str, parallel: bool, index: str) -> st.StructuralTag:
    """K3 turn with a forced / required call: reasoning (when on), an empty response block (no free text an
    untrained model could ramble in), the tools block, the message close."""
    if isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
        calls = _k3_call_tag(chosen[0], index)
    else:
        calls = st.TagsWithSeparatorFormat(tags=[_k3_call_tag(t, index) for t in tools], separator="", at_least_one=True,
                                           stop_after_first=not parallel)
    response = K3_RESPONSE_END if mode == "disabled" else K3_RESPONSE_BEGIN + K3_RESPONSE_END
    elements = _reasoning_prefix("k3", mode) + [
        st.ConstStringFormat(value=response + f"{OPEN}tools{SEP}"), calls,
        st.ConstStringFormat(value=f"{CLOSE}tools{SEP}" + K3_MESSAGE_END),
    ]
    return st.StructuralTag(format=st.SequenceFormat(elements=elements))


def _bounded_call_index(tag: st.StructuralTag, pattern: str) -> st.StructuralTag:
    """xgrammar writes a K2 call index as `\\d+`, which an untrained model can extend forever: bound it (a
    single call is call 1)."""

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "regex" and node.get("pattern") == r"\d+":
                return {**node, "pattern": pattern}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return st.StructuralTag.model_validate(walk(tag.model_dump()))


def _reasoning_prefix(family: str, mode: str) -> list:
    """The reasoning block of xgrammar's builtin tag for this mode (empty list when thinking is off)."""
    if mode == "disabled":
        return []
    tag = xgr.get_model_structural_tag(XGRAMMAR_MODEL[family], tools=None, tool_choice="auto", reasoning=mode)
    return [tag.format.elements[0]]


def _json_tag(family: str, schema, mode: str) -> st.StructuralTag:
    body = st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    elements = _reasoning_prefix(family, mode)
    if family == "k3":
        begin = "" if mode == "disabled" else K3_RESPONSE_BEGIN
        elements += [st.TagFormat(begin=begin, content=body, end=K3_RESPONSE_END), st.ConstStringFormat(value=K3_MESSAGE_END)]
    else:
        elements.append(body)
    return st.StructuralTag(format=st.SequenceFormat(elements=elements))


def json_schema_of(response_format: dict | None) -> dict | bool | None:
    """The schema a chat `response_format` asks for (None: plain text)."""
    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format["type"]
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise InputError("response_format.json_schema.schema: a JSON schema object is required")
        return schema
    raise InputError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def structural_tag_for(
    family: str, *, tools: list[dict] | None, tool_choice, response_format: dict | None, thinking: bool,
    starts_in_reasoning: bool, parallel_tool_calls: bool = True,
) -> st.StructuralTag | None:
    """The grammar a request needs, or None when nothing is enforced (tool_choice auto/none, text output)."""
    mode = reasoning_mode(family, thinking, starts_in_reasoning)
    if tools and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return _tools_tag(family, tools, tool_choice, mode, parallel_tool_calls)
    schema = json_schema_of(response_format)
    if schema is None:
        return None
    return _json_tag(family, schema, mode)


class GrammarLogitsProcessor:
    """The runtime's LogitsProcessor for one request: (output ids so far, logits [V] fp32, V the width the
    runtime samples from) -> the same logits with every token the grammar forbids at -inf. Tokens the runtime forced (thinking budget) are fed to the
    matcher too; `failed` is set if the output ever left the grammar (then it stops constraining)."""

    def __init__(self, vocab: GrammarVocab, compiled: xgr.CompiledGrammar) -> None:
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab.vocab_size)
        self.consumed = 0
        self.failed = False

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in output_ids[self.consumed:]:
            if not self.failed and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                self.failed = True
        self.consumed = len(output_ids)
        if self.failed or self.matcher.is_terminated():
            return logits
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.view(1, -1)
        width = min(row.shape[1], self.vocab.vocab_size)
        xgr.apply_token_bitmask_inplace(row, self.bitmask, vocab_size=width)
        row[0, :width][self.vocab.spells_marker[:width]] = float("-inf")
        row[0, width:] = float("-inf")
        return logits

    @property
    def completed(self) -> bool:
        """The output is a complete sentence of the grammar."""
        return not self.failed and (self.matcher.is_terminated() or self.matcher.is_completed())


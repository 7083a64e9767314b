"""Grammar-constrained decoding with xgrammar: forced tool calls and JSON response formats.

The grammar covers the whole assistant turn in the family's own output format, reasoning included: the
model reasons freely (the thinking budget still closes the block), then the part after reasoning is
constrained. K3 (XTML): a forced/required call is an empty response block then the tools block, one
argument element per parameter with string values exactly as the parser reads them (raw text); a JSON
format is the response block's body. K2: xgrammar's builtin Kimi tag (tool-calls section with JSON
arguments), or the JSON answer after `</think>`. The reasoning block is xgrammar's builtin one.

The markers are special tokens, and xgrammar matches text. Each marker is shown to xgrammar as one control
character of its own (its stand-in: U+0001, U+0002, ...) that no ordinary token spells (the few byte
tokens that hold one are never allowed while constrained) and that JSON strings and raw-text arguments
exclude: a marker can only be emitted as its own token, where the grammar places one, never inside a JSON
string or an argument. Every other special token (reserved ids, end-of-message markers) is never allowed
while constrained; the stop tokens only where the grammar ends. JSON is compiled from xgrammar's own
schema conversion with one correction: strings with a length bound or pattern would admit raw control
characters, which no JSON parser accepts; they are excluded as in xgrammar's unbounded strings.
Schemas are checked with `jsonschema` first, so a bad schema is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache

import torch
import xgrammar as xgr
from jsonschema import exceptions as schema_exceptions
from jsonschema import validators as schema_validators
from moe_export.common.errors import InputError
from moe_export.runtime.core.contracts import GrammarSpec
from moe_export.graphs.tokens import (
    CALL_ARGS,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    CLOSE,
    END_THINK,
    OPEN,
    SEP,
    THINK,
)
from xgrammar import structural_tag as st

K3_MARKERS = (OPEN, CLOSE, SEP)
K2_MARKERS = (THINK, END_THINK, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)
FAMILY_MARKERS = {"k3": K3_MARKERS, "k2": K2_MARKERS}
XGRAMMAR_MODEL = {"k3": "kimi_k3", "k2": "kimi"}
K3_RESPONSE_BEGIN, K3_RESPONSE_END, K3_MESSAGE_END = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}", f"{CLOSE}message{SEP}"
CALL_INDEX_PATTERN = "[1-9][0-9]?"  # K2 / K3 call index: 1-based position of the call
JSON_MAX_WHITESPACE = 1  # consecutive whitespace characters allowed inside constrained JSON / arguments
TAG_CACHE = 256  # structural tags remembered (`structural_tag_for`)
# a raw-text (K3 string argument) character: anything but C0 controls other than tab, newline, carriage return
# (the marker stand-ins are C0 controls, so an argument never holds a marker)
RAW_TEXT_CHAR = r"[^\x00-\x08\x0b\x0c\x0e-\x1f]"
# xgrammar's character class for a JSON string with a length bound or pattern admits raw control characters
# (its unbounded strings use the strict class): the strict class replaces it
_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
XTML_KIND = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
             "object": "object", "array": "array"}


def check_json_schema(schema, where: str) -> None:
    """InputError naming `where` unless `schema` is a valid JSON schema (its own meta-schema, regex patterns
    included)."""
    if not isinstance(schema, (dict, bool)):
        raise InputError(f"{where}: must be a JSON schema (an object), got {type(schema).__name__}")
    cls = schema_validators.validator_for(schema, default=schema_validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except schema_exceptions.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path)
        raise InputError(f"{where}: not a valid JSON schema: {exc.message}" + (f" (at {at})" if at else "")) from None
    check_enforceable(schema, where)


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not schemas


def check_enforceable(schema, where: str) -> None:
    """InputError naming `where` for a `$ref` outside the schema (never fetched; xgrammar would ignore it and
    allow any value) and for a `not` that every value fails (`not: {}`: no value satisfies the schema)."""
    stack = [(schema, "")]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise InputError(f"{where}: $ref {ref!r} is not a reference inside the schema (#/$defs/...)"
                             + (f" (at {at})" if at else ""))
        if node.get("not") is True or node.get("not") == {}:
            raise InputError(f"{where}: no value satisfies the schema (`not` of a schema every value satisfies)"
                             + (f" (at {at}/not)" if at else ""))
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, f"{at}/{key}/{name}") for name, v in value.items())
            elif isinstance(value, dict) and key not in DATA_KEYWORDS:
                stack.append((value, f"{at}/{key}"))
            elif isinstance(value, list) and key not in DATA_KEYWORDS:
                stack.extend((v, f"{at}/{key}/{i}") for i, v in enumerate(value))


def check_tool_parameters(parameters, where: str) -> None:
    """A tool's `parameters` / `input_schema`: a valid JSON schema of an object."""
    check_json_schema(parameters, where)
    if isinstance(parameters, bool) or parameters.get("type", "object") != "object":
        raise InputError(f"{where}: must be a JSON schema of type object")


def _xgrammar_error(exc: Exception) -> str:
    """xgrammar's message without its timestamp / source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


def json_grammar(schema) -> str:
    """EBNF of a JSON schema (xgrammar's conversion, strict string characters); InputError if it cannot be built."""
    try:
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True,
                                                max_whitespace_cnt=JSON_MAX_WHITESPACE, strict_mode=True))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InputError(f"cannot build a grammar for the JSON schema ({_xgrammar_error(exc)})") from None
    return ebnf.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)


class GrammarVocab:
    """The tokenizer as xgrammar sees it: ordinary tokens as their text, each marker as its stand-in
    character, every other special token (and every ordinary token holding a stand-in) as never allowed.

    vocab_size: the model's logits width (>= the tokenizer's); ids past the tokenizer are never allowed."""

    def __init__(self, tokenizer, family: str, vocab_size: int) -> None:
        if family not in FAMILY_MARKERS:
            raise InputError(f"structured output needs a Kimi chat family (k3 or k2), this engine's is {family!r}")
        markers = FAMILY_MARKERS[family]
        marker_ids = {m: tokenizer.token_to_id(m) for m in markers}
        if None in marker_ids.values():
            raise InputError(f"the tokenizer lacks the {family} markers {markers} needed for structured output")
        self.markers = markers
        self.stand_in = {m: chr(1 + i) for i, m in enumerate(markers)}
        stand_in_of_id = {marker_ids[m]: self.stand_in[m].encode() for m in markers}
        stand_in_bytes = tuple(c.encode() for c in self.stand_in.values())
        encoded: list[bytes] = []
        for i in range(tokenizer.vocab_size):
            if i in stand_in_of_id:
                encoded.append(stand_in_of_id[i])
                continue
            text = tokenizer.decode([i])
            if tokenizer.decode([i], skip_special_tokens=True) == "" and text:
                encoded.append(b"")  # another special token: xgrammar never allows an empty token
                continue
            piece = text.encode()
            encoded.append(b"" if any(c in piece for c in stand_in_bytes) else piece)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def lower(self, tag: st.StructuralTag) -> str:
        """The structural tag as xgrammar compiles it for this vocabulary (JSON text): JSON schemas as strict
        EBNF, markers as their stand-ins, and free text (reasoning) excluding every marker."""
        markers = list(self.markers)

        def walk(node):
            if isinstance(node, dict):
                if node.get("type") == "json_schema":
                    return {"type": "grammar", "grammar": json_grammar(node["json_schema"])}
                if node.get("type") == "any_text":
                    return {**node, "excludes": list(dict.fromkeys([*node.get("excludes", []), *markers]))}
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            return node

        text = json.dumps(walk(tag.model_dump()))
        for marker, char in self.stand_in.items():
            text = text.replace(marker, json.dumps(char)[1:-1])
        return text

    def _compile_uncached(self, tag_json: str) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_structural_tag(tag_json)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InputError(f"cannot build the output grammar ({_xgrammar_error(exc)})") from None

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The grammar of a lowered structural tag (compiled once per distinct tag: cached)."""
        with self._lock:
            return self._compile(spec.tag_json)

    def grammar(self, tag: st.StructuralTag) -> GrammarLogitsProcessor:
        """A fresh processor of `tag`'s grammar, with the spec it can be rebuilt from (`GrammarSpec`)."""
        return GrammarLogitsProcessor(self, GrammarSpec(self.lower(tag)))


def reasoning_mode(family: str, thinking: bool, starts_in_reasoning: bool) -> str:
    """xgrammar's reasoning mode: 'enabled' when the generation prompt opened the think block, 'auto'
    when the model may open it itself (K2), 'disabled' when thinking is off."""
    if not thinking:
        return "disabled"
    return "enabled" if starts_in_reasoning else "auto"


def _tools_tag(family: str, tools: list[dict], tool_choice, mode: str, parallel: bool) -> st.StructuralTag:
    index = "1" if isinstance(tool_choice, dict) or not parallel else CALL_INDEX_PATTERN
    for t in tools:
        fn = t["function"]
        check_tool_parameters(fn.get("parameters") or {"type": "object"}, f"tool {fn['name']!r} parameters")
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


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "object" if isinstance(value, dict) else "array"


def _resolve(schema, root: dict, where: str):
    """`schema` with a top-level local `$ref` replaced by its target (sibling keywords kept)."""
    seen: set[str] = set()
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InputError(f"{where}: $ref {ref!r} is not a reference inside the schema (#/$defs/...)")
        if ref in seen:
            raise InputError(f"{where}: $ref {ref!r} refers to itself")
        seen.add(ref)
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise InputError(f"{where}: $ref {ref!r} does not resolve inside the schema")
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}} if isinstance(target, dict) else target
    return schema


def _alternatives(schema, root: dict, where: str) -> list[tuple[str, dict]]:
    """A parameter's schema split into (JSON type, schema of that type) alternatives: type lists, anyOf /
    oneOf branches, untyped enums / consts and untyped schemas (any value) become one alternative per type."""
    schema = _resolve(schema, root, where)
    if schema is False:
        raise InputError(f"{where}: the schema `false` admits no value")
    if schema is True:
        schema = {}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return [alt for b in branches
                for alt in _alternatives({**base, **_resolve(b, root, where)} if isinstance(b, dict) else b, root, where)]
    if "const" in schema:
        types = [_json_type(schema["const"])]
    elif "enum" in schema:
        types = list(dict.fromkeys(_json_type(v) for v in schema["enum"]))
    elif isinstance(schema.get("type"), str):
        types = [schema["type"]]
    elif isinstance(schema.get("type"), list):
        types = list(schema["type"])
    else:
        types = list(XTML_KIND)
    out = []
    for t in types:
        if t not in XTML_KIND:
            raise InputError(f"{where}: unknown JSON type {t!r}")
        sub = {**schema, "type": t}
        if "enum" in schema:
            sub["enum"] = [v for v in schema["enum"] if _json_type(v) == t or (t == "number" and _json_type(v) == "integer")]
        out.append((t, sub))
    return out


def _raw_string_format(schema: dict):
    """A K3 string argument (raw text, exactly the value): const / enum literally, a pattern as a regex, else
    characters within minLength..maxLength."""
    if "const" in schema:
        return st.ConstStringFormat(value=str(schema["const"]))
    if schema.get("enum"):
        return st.OrFormat(elements=[st.ConstStringFormat(value=v) for v in schema["enum"]])
    if schema.get("pattern"):
        return st.RegexFormat(pattern=schema["pattern"])
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if high is None:
        return st.RegexFormat(pattern=f"{RAW_TEXT_CHAR}*" if low == 0 else f"{RAW_TEXT_CHAR}{{{low},}}")
    return st.RegexFormat(pattern=f"{RAW_TEXT_CHAR}{{{low},{int(high)}}}")


def _k3_argument(key: str, schema, root: dict, where: str):
    """One K3 argument element (or a choice of them, one per XTML type the schema admits). Strings are raw
    text; other types are JSON values of their schema (with the root's definitions, so nested $refs resolve)."""
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    by_kind: dict[str, list[dict]] = {}
    for json_type, sub in _alternatives(schema, root, f"{where} parameter {key!r}"):
        by_kind.setdefault(XTML_KIND[json_type], []).append(sub)
    attr_key = key.replace("&", "&amp;").replace('"', "&quot;")
    tags = []
    for kind, subs in by_kind.items():
        if kind == "string":
            formats = [_raw_string_format(s) for s in subs]
            value = formats[0] if len(formats) == 1 else st.OrFormat(elements=formats)
        else:
            value = st.JSONSchemaFormat(json_schema={**(subs[0] if len(subs) == 1 else {"anyOf": subs}), **defs},
                                        max_whitespace_cnt=JSON_MAX_WHITESPACE)
        tags.append(st.TagFormat(begin=f'{OPEN}argument key="{attr_key}" type="{kind}"{SEP}', content=value,
                                 end=f"{CLOSE}argument{SEP}"))
    return tags[0] if len(tags) == 1 else st.OrFormat(elements=tags)


def _k3_call_tag(tool: dict, index_pattern: str) -> st.TagFormat:
    """`<|open|>call tool="NAME" index="I"<|sep|>` + one argument element per parameter (required ones
    always, optional ones optionally, in schema order) + `<|close|>call<|sep|>`."""
    fn = tool["function"]
    where = f"tool {fn['name']!r}"
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    required = set(params.get("required", []))
    elements: list = [st.RegexFormat(pattern=index_pattern), st.ConstStringFormat(value='"' + SEP)]
    for key, schema in (params.get("properties") or {}).items():
        arg = _k3_argument(key, schema, params, where)
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
        check_json_schema(schema, "response_format.json_schema.schema")
        return schema
    raise InputError(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def structural_tag_for(
    family: str, *, tools: list[dict] | None, tool_choice, response_format: dict | None, thinking: bool,
    starts_in_reasoning: bool, parallel_tool_calls: bool = True,
) -> st.StructuralTag | None:
    """The grammar a request needs, or None when nothing is enforced (tool_choice auto/none, text output). Built
    once per distinct set of arguments (an agent sends the same tools every turn: their schemas are checked and
    their tag built on the first): the key is the arguments' JSON text, key order included (the tag follows it),
    for arguments that JSON gives back equal (else the tag is built each time). Callers must not change the tag."""
    args = [family, tools, tool_choice, response_format, thinking, starts_in_reasoning, parallel_tool_calls]
    try:
        key = json.dumps(args)
        exact = json.loads(key) == args
    except (TypeError, ValueError):
        exact = False
    return _structural_tag_of_json(key) if exact else _structural_tag(*args)


@lru_cache(maxsize=TAG_CACHE)
def _structural_tag_of_json(key: str) -> st.StructuralTag | None:
    return _structural_tag(*json.loads(key))


def _structural_tag(family: str, tools: list[dict] | None, tool_choice, response_format: dict | None, thinking: bool,
                    starts_in_reasoning: bool, parallel_tool_calls: bool) -> st.StructuralTag | None:
    mode = reasoning_mode(family, thinking, starts_in_reasoning)
    if tools and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return _tools_tag(family, tools, tool_choice, mode, parallel_tool_calls)
    schema = json_schema_of(response_format)
    if schema is None:
        return None
    return _json_tag(family, schema, mode)


def pack_bits(allowed: torch.Tensor, words: int) -> torch.Tensor:
    """bool [V] -> int32 [words] in xgrammar's bitmask layout (bit j of word i: token 32 i + j; past V: 0)."""
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.shape[0]] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class GrammarLogitsProcessor:
    """One request's grammar as the engine core uses it: `fill_bitmask(output ids so far, int32 row)` writes
    the tokens the grammar allows next, and the runner applies every constrained row's mask in one batched
    pass (the runtime samples ids below the tokenizer's size only). Tokens the runtime forced (thinking budget)
    are fed to the matcher too; `failed` is set if the output ever left the grammar (then it stops
    constraining). Called as a LogitsProcessor ((output ids, logits [V]) -> logits) it masks one row.

    spec: what it is built from; a dp-layout group leader builds the request's own processor from it with its
    own vocabulary, and rank 0 keeps this one in step with `advance` (`core.wide_ep`)."""

    def __init__(self, vocab: GrammarVocab, spec: GrammarSpec) -> None:
        self.vocab, self.spec = vocab, spec
        self.bitmask_width = xgr.get_bitmask_shape(1, vocab.vocab_size)[1]
        self.matcher = xgr.GrammarMatcher(vocab.compile(spec))
        self.consumed = 0
        self.failed = False

    def advance(self, output_ids: list[int]) -> None:
        """Feed the matcher the output ids past those it has seen (`output_ids`: the whole output so far)."""
        for token in output_ids[self.consumed:]:
            if not self.failed and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                self.failed = True
        self.consumed = len(output_ids)

    def fill_bitmask(self, output_ids: list[int], row: torch.Tensor) -> bool:
        """Advance over the new output ids and write the next token's mask into `row` [bitmask_width] int32;
        False (row untouched) when the grammar no longer constrains (completed, or the output left it)."""
        self.advance(output_ids)
        if self.failed or self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(row.view(1, -1))
        return True

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        row = torch.empty(self.bitmask_width, dtype=torch.int32)
        if self.fill_bitmask(output_ids, row):
            width = min(logits.shape[0], self.vocab.vocab_size)
            xgr.apply_token_bitmask_inplace(logits.view(1, -1), row.view(1, -1), vocab_size=width)
            logits[width:] = float("-inf")
        return logits

    @property
    def completed(self) -> bool:
        """The output is a complete sentence of the grammar."""
        return not self.failed and (self.matcher.is_terminated() or self.matcher.is_completed())


"""Server parts that need no engine: the SQLite response store, API -> chat message conversions, and
grammar-constrained decoding over the synthetic Kimi tokenizers with random logits (the grammar, not the
model, must make the output parse; the runtime's own output parser reads it back)."""

from __future__ import annotations

import json
import sqlite3

import jsonschema
import pytest
import torch
from moe_export.common.errors import InputError
from moe_export.export.convert.synth import write_synthetic_tokenizer
from moe_export.runtime.chat import parse_output
from moe_export.runtime.core.structured import (
    GrammarVocab,
    structural_tag_for,
)
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.store import (
    MissingResponse,
    ResponseStore,
    StoredResponse,
    key_scope,
)
from moe_export.runtime.tokenizer import load_tokenizer


def test_store_chain_scope_and_reopen(tmp_path):
    path = tmp_path / "h.sqlite"
    store = ResponseStore(path)
    a, b = key_scope("key-a"), key_scope("key-b")
    user1, asst1 = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r1"}
    store.put(StoredResponse("resp_1", None, [{"role": "user", "content": "hi"}], [user1], asst1, {"id": "resp_1"}), a)
    user2 = {"role": "user", "content": "more"}
    store.put(StoredResponse("resp_2", "resp_1", [], [user2], {"role": "assistant", "content": "ok"}, {"id": "resp_2"}), a)
    store.close()
    reopened = ResponseStore(path)  # a new process would see exactly this
    assert reopened.history("resp_2", a) == [user1, asst1, user2, {"role": "assistant", "content": "ok"}]
    assert reopened.get("resp_2", b) is None
    with pytest.raises(MissingResponse):
        reopened.history("resp_2", b)
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(sqlite3.IntegrityError):  # one row per id; a failed insert leaves the store as it was
        reopened.put(StoredResponse("resp_1", None, [], [], {}, {}), a)
    assert reopened.delete("resp_1", b) is False and reopened.delete("resp_1", a) is True
    with pytest.raises(MissingResponse) as gone:  # an ancestor is gone: the chain is incomplete, and it is named
        reopened.history("resp_2", a)
    assert gone.value.response_id == "resp_1"


def test_responses_items_become_one_assistant_message_with_reasoning_and_calls():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think <|open|>"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    assert convert.messages_from_responses_input(items) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "reasoning_content": "think <|open|>",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with pytest.raises(InputError, match=r"input\[0\]\.type"):
        convert.messages_from_responses_input([{"type": "web_search_call"}])


def test_anthropic_blocks_and_openai_reasoning_field():
    msgs = convert.messages_from_anthropic("be brief", [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": [1, 2]}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "3"}]},
                                     {"type": "text", "text": "thanks"}]},
    ])
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "user", "content": "thanks"},
    ]
    assert convert.chat_messages_from_openai([{"role": "assistant", "content": None, "reasoning": "r"}]) == [
        {"role": "assistant", "content": "", "reasoning_content": "r"}]
    assert convert.anthropic_effort({"type": "enabled", "budget_tokens": 100}) == 100
    assert convert.anthropic_effort({"type": "disabled"}) == "none"
    with pytest.raises(InputError, match="not among the declared tools"):
        convert.normalize_tool_choice({"type": "function", "function": {"name": "g"}},
                                      [{"type": "function", "function": {"name": "f"}}])


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}}]
ANSWER_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
                 "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for family in ("k3", "k2"):
        d = tmp_path_factory.mktemp(f"tok-{family}")
        write_synthetic_tokenizer(d, family, 4096)
        out[family] = load_tokenizer(d)
    return out


VOCABS: dict[str, GrammarVocab] = {}


def constrained_random_decode(tok, family, tag, *, seed: int, forced_close: list[int] | None, steps: int = 300,
                              bias: torch.Tensor | None = None):
    """Greedy decode over random logits (+ `bias`) through the grammar; `forced_close` is injected after 12
    tokens unless the model already began it (as the thinking budget does). Returns (output ids, processor)."""
    if family not in VOCABS:
        VOCABS[family] = GrammarVocab(tok, family, tok.vocab_size + 8)
    vocab = VOCABS[family]
    proc = vocab.grammar(tag)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(steps):
        if forced_close and step == 12 and forced_close[0] not in out:
            out.extend(forced_close)
        logits = torch.randn(vocab.vocab_size, generator=gen)
        if bias is not None:
            logits += bias
        t = int(proc(out, logits).argmax())
        out.append(t)
        if t in tok.eos_token_ids:
            break
    return out, proc


def k3_close_think(tok) -> list[int]:
    sp = tok.encode_special
    return [sp("<|close|>"), *tok.encode("think"), sp("<|sep|>"), sp("<|open|>"), *tok.encode("response"), sp("<|sep|>")]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_forced_tool_call_always_parses(tokenizers, thinking, seed):
    tok = tokenizers["k3"]
    tag = structural_tag_for("k3", tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                             response_format=None, thinking=thinking, starts_in_reasoning=thinking)
    out, proc = constrained_random_decode(tok, "k3", tag, seed=seed, forced_close=k3_close_think(tok) if thinking else None)
    assert proc.completed and not proc.failed and out[-1] in tok.eos_token_ids
    # every marker is its own special token, never spelled from text pieces
    assert tok.decode(out, skip_special_tokens=True).count("<|") == 0
    assert '<|open|>call tool="get_weather" index="1"<|sep|>' in tok.decode(out)
    parsed = parse_output(tok, "k3", out, starts_in_reasoning=thinking)
    assert parsed.tool_call_parse_failures == 0 and not parsed.content
    (call,) = parsed.tool_calls
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER[0]["function"]["parameters"])
    assert bool(parsed.reasoning_content) == thinking


@pytest.mark.parametrize("family", ["k3", "k2"])
@pytest.mark.parametrize("seed", [0, 3])
def test_json_schema_response_format_validates(tokenizers, family, seed):
    tok = tokenizers[family]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    tag = structural_tag_for(family, tools=None, tool_choice=None, response_format=fmt, thinking=False, starts_in_reasoning=False)
    out, proc = constrained_random_decode(tok, family, tag, seed=seed, forced_close=None)
    assert proc.completed and out[-1] in tok.eos_token_ids
    parsed = parse_output(tok, family, out, starts_in_reasoning=False)
    jsonschema.validate(json.loads(parsed.content), ANSWER_SCHEMA)


def test_k2_required_tool_call_with_reasoning(tokenizers):
    tok = tokenizers["k2"]
    tag = structural_tag_for("k2", tools=WEATHER, tool_choice="required", response_format=None, thinking=True,
                             starts_in_reasoning=True, parallel_tool_calls=False)
    out, proc = constrained_random_decode(tok, "k2", tag, seed=5, forced_close=[tok.encode_special("</think>")])
    assert proc.completed
    assert "</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1" in tok.decode(out)
    parsed = parse_output(tok, "k2", out, starts_in_reasoning=True)
    (call,) = parsed.tool_calls
    assert parsed.tool_call_parse_failures == 0 and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER[0]["function"]["parameters"])


NOTE_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "tag": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["a", "b"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"x": {"type": ["integer", "null"]}}, "required": ["x"]}},
    "required": ["title", "tag", "kind", "tags", "inner"], "additionalProperties": False}


def tempting_bias(tok, width: int) -> torch.Tensor:
    """+3 on every special token, every token holding a control character or a quote: what a model that
    wants to break the JSON would favour (the quote also ends strings in reasonable time)."""
    bias = torch.zeros(width)
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if tok.is_special(i) or '"' in text or any(ord(c) < 32 for c in text):
            bias[i] = 3.0
    return bias


def only_markers_and_eos(tok, family, ids) -> bool:
    """Every special token in `ids` is one of the family's markers or an eos id."""
    from moe_export.runtime.core.structured import FAMILY_MARKERS

    allowed = {tok.token_to_id(m) for m in FAMILY_MARKERS[family]} | set(tok.eos_token_ids)
    return all(t in allowed for t in ids if tok.is_special(t))


@pytest.mark.parametrize("family, thinking", [("k3", True), ("k3", False), ("k2", False)])
@pytest.mark.parametrize("seed", range(6))
def test_json_with_free_strings_parses_strictly_and_is_what_the_client_gets(tokenizers, family, thinking, seed):
    """Random logits favour every special token and every control character inside strings: the grammar
    must still give strict JSON (json.loads rejects raw control characters) that validates, with no special
    token but the markers, and the parsed content must be exactly the constrained JSON text."""
    tok = tokenizers[family]
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": NOTE_SCHEMA}}
    tag = structural_tag_for(family, tools=None, tool_choice=None, response_format=fmt, thinking=thinking,
                             starts_in_reasoning=thinking)
    bias = tempting_bias(tok, tok.vocab_size + 8)
    out, proc = constrained_random_decode(tok, family, tag, seed=seed, forced_close=k3_close_think(tok) if thinking else None,
                                          bias=bias, steps=2000)
    assert proc.completed and out[-1] in tok.eos_token_ids and only_markers_and_eos(tok, family, out)
    parsed = parse_output(tok, family, out, starts_in_reasoning=thinking)
    value = json.loads(parsed.content)  # strict: no raw control characters
    jsonschema.validate(value, NOTE_SCHEMA)
    assert parsed.content in tok.decode(out)


def test_k3_tool_arguments_honour_max_length_and_optional_and_nested_pydantic_models(tokenizers):
    """Schemas as the openai client's pydantic_function_tool writes them: Optional[int] (anyOf with null), a
    nested model ($ref into $defs), a list field, a maxLength string."""
    import openai
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=5)
        zip: int | None = None

    class Lookup(BaseModel):
        name: str = Field(max_length=4)
        age: int | None
        address: Address
        tags: list[str]

    tool = openai.pydantic_function_tool(Lookup)
    params = tool["function"]["parameters"]
    assert "$defs" in params and "anyOf" in json.dumps(params)
    tok = tokenizers["k3"]
    tag = structural_tag_for("k3", tools=[tool], tool_choice="required", response_format=None, thinking=False,
                             starts_in_reasoning=False)
    bias = tempting_bias(tok, tok.vocab_size + 8)
    for seed in range(4):
        out, proc = constrained_random_decode(tok, "k3", tag, seed=seed, forced_close=None, steps=2000, bias=bias)
        assert proc.completed and only_markers_and_eos(tok, "k3", out)
        parsed = parse_output(tok, "k3", out, starts_in_reasoning=False)
        assert parsed.tool_calls and parsed.tool_call_parse_failures == 0
        for call in parsed.tool_calls:
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, params)
            Lookup.model_validate(args)
    nullable = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 3}}, "required": ["note"]}}}]
    tag = structural_tag_for("k3", tools=nullable, tool_choice="required", response_format=None, thinking=False,
                             starts_in_reasoning=False, parallel_tool_calls=False)
    seen = set()
    for seed in range(8):
        out, proc = constrained_random_decode(tok, "k3", tag, seed=seed, forced_close=None)
        (call,) = parse_output(tok, "k3", out, starts_in_reasoning=False).tool_calls
        note = json.loads(call["function"]["arguments"])["note"]
        assert note is None or len(note) <= 3
        seen.add(type(note))
    assert seen == {str, type(None)}


@pytest.mark.parametrize("schema, message", [
    ({"type": "objekt"}, "not a valid JSON schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "Missing"),
    ({"type": "string", "pattern": "(("}, "not a valid JSON schema"),
    ("a string", "JSON schema"),
    ({"$ref": "https://example.com/schema.json"}, "not a reference inside the schema"),  # never fetched
    ({"type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/s.json"}}}, "not a reference inside"),
    ({"not": {}}, "no value satisfies the schema"),
    ({"type": "object", "properties": {"a": {"not": True}}}, "no value satisfies the schema"),
])
def test_bad_schemas_are_input_errors(tokenizers, schema, message):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}}]
    vocab = VOCABS.setdefault("k3", GrammarVocab(tokenizers["k3"], "k3", tokenizers["k3"].vocab_size + 8))
    for kwargs in ({"tools": None, "tool_choice": None, "response_format": fmt},
                   {"tools": tools, "tool_choice": "required", "response_format": None}):
        with pytest.raises(InputError, match=message):
            vocab.grammar(structural_tag_for("k3", thinking=False, starts_in_reasoning=False, **kwargs))


def test_tool_tags_are_built_once_per_distinct_request(monkeypatch):
    """An agent sends the same tools every turn: their schemas are checked and their tag built once; other tools, the
    same properties in another order (the call's argument order follows it), or arguments that JSON does not give
    back equal, are built again; a bad schema fails every time."""
    import moe_export.runtime.core.structured as structured

    checked = []
    check = structured.check_tool_parameters
    monkeypatch.setattr(structured, "check_tool_parameters", lambda p, where: checked.append(where) or check(p, where))
    tools = json.loads(json.dumps(WEATHER))
    tools[0]["function"]["name"] = "weather_once"  # (not built by another test: the cache lives as long as the process)
    kwargs = dict(tool_choice="required", response_format=None, thinking=True, starts_in_reasoning=True)
    first = structural_tag_for("k3", tools=tools, **kwargs)
    assert structural_tag_for("k3", tools=json.loads(json.dumps(tools)), **kwargs) is first
    assert len(checked) == 1
    props = tools[0]["function"]["parameters"]["properties"]
    swapped = json.loads(json.dumps(tools))
    swapped[0]["function"]["parameters"]["properties"] = dict(reversed(props.items()))
    other = structural_tag_for("k3", tools=swapped, **kwargs)
    assert len(checked) == 2 and other.model_dump() != first.model_dump()
    # a tuple is not a JSON array (jsonschema refuses it), but JSON would give a list back: not keyed by its JSON
    as_tuple = [{**tools[0], "function": {**tools[0]["function"], "parameters": {
        **tools[0]["function"]["parameters"], "required": ("city", "days")}}}]
    for _ in range(2):
        with pytest.raises(InputError, match="is not of type 'array'"):
            structural_tag_for("k3", tools=as_tuple, **kwargs)
    assert len(checked) == 4
    bad = json.loads(json.dumps(tools))
    bad[0]["function"]["parameters"]["properties"]["city"] = {"type": "no-such-type"}
    for _ in range(2):
        with pytest.raises(InputError, match="not a valid JSON schema"):
            structural_tag_for("k3", tools=bad, **kwargs)
    assert len(checked) == 6


def test_no_grammar_for_auto_tools_or_text():
    assert structural_tag_for("k3", tools=WEATHER, tool_choice="auto", response_format=None, thinking=True,
                              starts_in_reasoning=True) is None
    with pytest.raises(InputError, match="response_format.type"):
        structural_tag_for("k3", tools=None, tool_choice=None, response_format={"type": "xml"}, thinking=True,
                           starts_in_reasoning=True)


@pytest.mark.parametrize("args, message", [
    (["serve", "/nonexistent/engine"], "not an engine directory"),
    (["serve", ".", "--port", "0"], "--port"),
    (["serve", ".", "--default-effort", "extreme"], "--default-effort"),
    (["serve", ".", "--host", "example.com"], "--host"),
    (["serve", ".", "--allow-private-image-urls"], "--allow-private-image-urls needs --allow-image-urls"),
])
def test_serve_cli_bad_input_exits_2(capsys, tmp_path, monkeypatch, args, message):
    """Bad arguments are refused before any engine is loaded."""
    from conftest import run_cli, write_engine_config

    write_engine_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_serve_busy_port_is_a_clear_error():
    from moe_export.runtime.entrypoints.server.launch import listening_socket

    with listening_socket("127.0.0.1", 0) as taken:
        taken.listen()
        with pytest.raises(InputError, match=rf"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            listening_socket("127.0.0.1", taken.getsockname()[1]).close()


def test_k3_call_ids_count_on_across_turns(tokenizers):
    """K3 call ids `functions.NAME:N` are unique across a conversation's turns: the input processor counts the calls
    of the conversation's assistant turns and the request's output parser numbers the new turn's calls on from there
    (before the turn is remembered, so a resent history renders as the generated tokens)."""
    from moe_export.runtime.processor import InputProcessor
    from moe_export.runtime.sampling import SamplingParams

    tok = tokenizers["k3"]
    processor = InputProcessor(tok, vision=None, thinking_caps={"low": 64}, default_effort="low", turns=None,
                               fetch_image_url=None, vocab_size=4096, default_sampling=SamplingParams(), engine_dir=None)
    first = {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [first]},
               {"role": "tool", "tool_call_id": first["id"], "content": "sun"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    tag = structural_tag_for("k3", tools=WEATHER, tool_choice=named, response_format=None, thinking=False,
                             starts_in_reasoning=False)
    out, _ = constrained_random_decode(tok, "k3", tag, seed=0, forced_close=None)
    for conversation, want in ((history[:1], "functions.get_weather:0"), (history, "functions.get_weather:1")):
        parser = processor.chat(conversation, tools=WEATHER, tool_choice=named, reasoning_effort="none").parser
        parser.feed(out)
        assert [call["id"] for call in parser.finish().tool_calls] == [want]

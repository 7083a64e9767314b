"""Our chat renderers against the vendors' renderers, byte for byte, and render -> parse round trips.

Oracles (their code is not in this repository; see tests/data/make_chat_conformance.py, which produced
tests/data/chat_conformance.json, and the data's `source` field for the exact commits):
  - K3: the vendor's `encoding_k3.py` (`build_chat_segments`) from vllm-project/vllm
    `vllm/tokenizers/encoding_k3.py` @ 2ec5134c, run outside the repository on tests/chat_corpus.py: the text
    and the segments (each text piece is tokenized alone by the vendor's tokenizer, so the cuts matter).
  - K2-Thinking: the vendor's chat template (ggml-org/llama.cpp `models/templates/moonshotai-Kimi-K2-Thinking.jinja`
    @ 0c3c896e with the vendor's `tools | tojson(separators=(',', ':'))` restored), rendered by transformers
    5.24's `apply_chat_template` with the tools deep-sorted first, as the vendor's tokenizer code does.
The stored texts are data, not the vendors' code; the template text itself is not stored (transformers ships
no Kimi template, and the renderings are what the test needs). Checkpoint templates, which the runtime renders
with its own sandboxed Jinja environment, are compared live with transformers in tests/test_chat_template.py.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from chat_corpus import ERROR_CASES, cases
from moe_export.common.errors import InputError
from moe_export.runtime.chat import (
    parse_output,
    output_starts_in_reasoning,
    render,
    render_ids,
    render_segments,
    segments_to_ids,
)
from moe_export.runtime.formats.common import Segment

DATA = json.loads((Path(__file__).parent / "data" / "chat_conformance.json").read_text())
CASES = cases()


def test_corpus_covers_both_families_and_the_options():
    by_family = {f: [c for c in CASES if c["family"] == f] for f in ("k3", "k2")}
    assert len(by_family["k3"]) >= 40 and len(by_family["k2"]) >= 40
    assert set(DATA["cases"]) == {c["id"] for c in CASES}
    k3_options = [c["options"] for c in by_family["k3"]]
    assert {o.get("thinking_effort") for o in k3_options} >= {None, "low", "high", "max", "none"}
    assert {o.get("thinking", True) for o in k3_options} == {True, False}
    assert {str(o.get("tool_choice")) for o in k3_options} >= {"required", "none", "auto"}
    assert {(o.get("response_format") or {}).get("type") for o in k3_options} >= {None, "json_object", "json_schema"}
    assert {o.get("add_generation_prompt", True) for o in k3_options} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_renders_byte_for_byte_as_the_vendor(case, toks):
    want = DATA["cases"][case["id"]]
    messages = copy.deepcopy(case["messages"])
    kwargs = {"family": case["family"], "tools": case["tools"], **case["options"]}
    assert render(messages, **kwargs) == want["text"]
    assert messages == case["messages"]  # the caller's messages are not changed
    if case["family"] == "k3":
        segments = render_segments(messages, **kwargs)
        assert [[s.text, s.special] for s in segments] == want["segments"]
        # token ids: every vendor segment tokenized alone, markers as special tokens
        tok = toks["k3"]
        vendor = segments_to_ids(tok, [Segment(t, special) for t, special in want["segments"]])
        assert render_ids(tok, messages, **kwargs) == vendor
    elif not any(name in json.dumps(case["messages"], ensure_ascii=False) for name in toks["k2"].special_tokens):
        # token ids: what tokenizing the vendor's rendered string gives (split at the markers, the text between
        # encoded whole); a typed marker in a message would be a control token there, never here
        tok = toks["k2"]
        pieces = re.split("(" + "|".join(map(re.escape, tok.special_tokens)) + ")", want["text"])
        vendor = [t for k, p in enumerate(pieces) if p for t in ([tok.encode_special(p)] if k % 2 else tok.encode(p))]
        assert render_ids(tok, messages, **kwargs) == vendor


@pytest.mark.parametrize("cid, family, messages, tools, options", ERROR_CASES, ids=[e[0] for e in ERROR_CASES])
def test_refuses_what_the_vendor_refuses(cid, family, messages, tools, options):
    with pytest.raises(InputError) as err:
        render(messages, family=family, tools=tools, **options)
    assert DATA["errors"][cid] in str(err.value)


def _round_trips(tok, case) -> int:
    """For each assistant message whose rendering extends the rendering of the conversation before it plus the
    generation prompt: parse the extension (the output a model would write) and check that the parsed message
    renders to the same text. Returns how many messages were checked."""
    family, messages, opts = case["family"], case["messages"], dict(case["options"])
    opts.pop("add_generation_prompt", None)
    thinking = opts.get("thinking", True) and opts.get("thinking_effort") != "none"
    checked = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = render_ids(tok, messages[:i], family=family, tools=case["tools"], **opts)
        full = render_ids(tok, messages[:i + 1], family=family, tools=case["tools"], add_generation_prompt=False, **opts)
        if full[:len(prompt)] != prompt:  # e.g. K3's tool-choice message after the conversation, a named assistant
            continue
        parsed = parse_output(tok, family, full[len(prompt):], starts_in_reasoning=output_starts_in_reasoning(family, thinking),
                              tools_declared=True)
        assert parsed.tool_call_parse_failures == 0, case["id"]
        again = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning_content,
                 "tool_calls": parsed.tool_calls or None}
        kwargs = {"family": family, "tools": case["tools"], "add_generation_prompt": False, **opts}
        want = _parsed_k2_arguments(msg) if family == "k2" else msg
        assert render([*messages[:i], again], **kwargs) == render([*messages[:i], want], **kwargs), (case["id"], i)
        checked += 1
    return checked


def _parsed_k2_arguments(msg: dict) -> dict:
    """`msg` with its K2 arguments strings as the parser returns them: without surrounding whitespace, `{}`
    when empty."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    fixed = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"].strip() or "{}"}}
             if isinstance(c["function"].get("arguments"), str) else c for c in calls]
    return {**msg, "tool_calls": fixed}


def test_render_parse_round_trips_over_the_corpus(toks):
    checked = {f: sum(_round_trips(toks[f], c) for c in CASES if c["family"] == f) for f in ("k3", "k2")}
    assert checked["k3"] >= 40 and checked["k2"] >= 30, checked

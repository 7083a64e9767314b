"""The output parser on the edge cases where vLLM's Kimi K2 / K3 reasoning and tool parsers set the behaviour
(see the docstring of runtime/formats/parsing.py), whole and streamed token by token."""

from __future__ import annotations

import json

import pytest

from moe_export.runtime.chat import OutputParser, output_starts_in_reasoning, parse_output

SPECIAL_NAMES = ("<|", "|>", "<think>", "</think>")


def streamed_calls(deltas) -> tuple[list[dict], list[dict]]:
    """The tool calls a stream of ParsedDeltas adds up to: (those that ended "done", in OpenAI shape; those that
    ended "failed", with the arguments they streamed), after checking each call opens once, with an id and a
    name, and gets pieces only while open."""
    calls: dict[int, dict] = {}
    ends: dict[int, str] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls and piece.name
                calls[piece.index] = {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
            assert piece.index in calls and piece.index not in ends
            calls[piece.index]["function"]["arguments"] += piece.arguments
            if piece.end is not None:
                ends[piece.index] = piece.end
    assert sorted(ends) == sorted(calls)  # every call that opened ended
    return ([c for i, c in sorted(calls.items()) if ends[i] == "done"],
            [c for i, c in sorted(calls.items()) if ends[i] == "failed"])


def parsed_both_ways(tok, family, ids, *, thinking=True, tools_declared=True):
    """The whole parse of `ids`, after checking that a stream adds up to it, token by token and in chunks: its text
    by channel, and its tool calls piece by piece (ids, names and arguments exactly)."""
    starts = output_starts_in_reasoning(family, thinking)
    whole = parse_output(tok, family, ids, starts_in_reasoning=starts, tools_declared=tools_declared)
    for chunk in (1, 4):
        parser = OutputParser(tok, family, starts_in_reasoning=starts, tools_declared=tools_declared)
        deltas = [parser.feed(ids[k:k + chunk]) for k in range(0, len(ids), chunk)]
        assert parser.finish() == whole
        deltas.append(parser.delta)
        assert "".join(d.reasoning for d in deltas) == (whole.reasoning_content or "")
        assert "".join(d.content for d in deltas) == (whole.content or "")
        assert streamed_calls(deltas)[0] == whole.tool_calls
    return whole


def k2_call(tok, cid, args, *, close=True):
    s = tok.encode_special
    ids = [s("<|tool_call_begin|>"), *tok.encode(cid), s("<|tool_call_argument_begin|>"), *tok.encode(args)]
    return ids + ([s("<|tool_call_end|>")] if close else [])


def k3_call(tok, tool, arguments, *, close=True):
    """arguments: (attribute text, value) per argument element."""
    s = tok.encode_special
    ids = [s("<|open|>"), *tok.encode(f'call tool="{tool}" index="1"'), s("<|sep|>")]
    for attrs, value in arguments:
        ids += [s("<|open|>"), *tok.encode(f"argument {attrs}"), s("<|sep|>"), *tok.encode(value),
                s("<|close|>"), *tok.encode("argument"), s("<|sep|>")]
    return ids + ([s("<|close|>"), *tok.encode("call"), s("<|sep|>")] if close else [])


def tool_section(tok, family, calls, *, close=True):
    s = tok.encode_special
    if family == "k2":
        return [s("<|tool_calls_section_begin|>"), *calls] + ([s("<|tool_calls_section_end|>")] if close else [])
    return [s("<|open|>"), *tok.encode("tools"), s("<|sep|>"), *calls] + (
        [s("<|close|>"), *tok.encode("tools"), s("<|sep|>")] if close else [])


def a_call(tok, family, *, close=True):
    if family == "k2":
        return k2_call(tok, "functions.f:0", '{"a": 1}', close=close)
    return k3_call(tok, "f", [('key="a" type="number"', "1")], close=close)


def answer_prefix(tok, family):
    """The output up to the answer text: reasoning R closed, answer channel open."""
    s = tok.encode_special
    if family == "k2":
        return [*tok.encode("R"), s("</think>")]
    return [*tok.encode("R"), s("<|close|>"), *tok.encode("think"), s("<|sep|>"), s("<|open|>"), *tok.encode("response"), s("<|sep|>")]


def test_k2_thinking_output_is_reasoning_until_the_think_close(toks):
    """K2-Thinking's generation prompt has no <think>: the output is reasoning until </think> (vLLM's kimi_k2)."""
    tok = toks["k2"]
    s = tok.encode_special
    split = parsed_both_ways(tok, "k2", [*tok.encode("R"), s("</think>"), *tok.encode("answer"), s("<|im_end|>")])
    assert (split.reasoning_content, split.content) == ("R", "answer")
    opened = parsed_both_ways(tok, "k2", [s("<think>"), *tok.encode("R"), s("</think>"), *tok.encode("answer")])
    assert (opened.reasoning_content, opened.content) == ("R", "answer")  # the model's own <think> is consumed
    unfinished = parsed_both_ways(tok, "k2", tok.encode("still thinking"))
    assert (unfinished.reasoning_content, unfinished.content) == ("still thinking", None)
    # reasoning ends implicitly at a tool section
    ended = parsed_both_ways(tok, "k2", [*tok.encode("R"), *tool_section(tok, "k2", a_call(tok, "k2"))])
    assert ended.reasoning_content == "R" and ended.content is None and len(ended.tool_calls) == 1
    # thinking off: everything is content
    off = parsed_both_ways(tok, "k2", tok.encode("plain answer"), thinking=False)
    assert (off.reasoning_content, off.content) == (None, "plain answer")


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_tool_call_cut_by_max_tokens_leaks_no_markup(toks, family):
    tok = toks[family]
    ids = answer_prefix(tok, family) + tok.encode("Let me check.") + tool_section(tok, family, a_call(tok, family, close=False), close=False)
    parsed = parsed_both_ways(tok, family, ids)
    assert parsed.content == "Let me check." and parsed.tool_calls == []
    assert parsed.tool_call_parse_failures == 1


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_tool_call_without_declared_tools_leaks_no_markup(toks, family):
    tok = toks[family]
    ids = answer_prefix(tok, family) + tok.encode("Sure.") + tool_section(tok, family, a_call(tok, family))
    parsed = parsed_both_ways(tok, family, ids, tools_declared=False)
    assert parsed.content == "Sure." and parsed.tool_calls == [] and parsed.tool_call_parse_failures == 1
    declared = parsed_both_ways(tok, family, ids)
    assert declared.content == "Sure." and len(declared.tool_calls) == 1 and declared.tool_call_parse_failures == 0


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_text_after_the_tool_section_is_dropped(toks, family):
    tok = toks[family]
    s = tok.encode_special
    after = tok.encode(" trailing words") + ([s("<think>"), *tok.encode("more")] if family == "k2" else
                                            [s("<|open|>"), *tok.encode("response"), s("<|sep|>"), *tok.encode("more")])
    ids = answer_prefix(tok, family) + tok.encode("Checking.") + tool_section(tok, family, a_call(tok, family)) + after
    parsed = parsed_both_ways(tok, family, ids)
    assert (parsed.reasoning_content, parsed.content) == ("R", "Checking.")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"]


def test_k2_arguments_trimmed_and_empty_arguments_are_an_object(toks):
    tok = toks["k2"]
    calls = k2_call(tok, " functions.f:0 ", ' \n{"a": 1}\n ') + k2_call(tok, "functions.g:1", "") + k2_call(tok, "functions.h:2", "  ")
    parsed = parsed_both_ways(tok, "k2", answer_prefix(tok, "k2") + tool_section(tok, "k2", calls))
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [
        ("functions.f:0", "f", '{"a": 1}'), ("functions.g:1", "g", "{}"), ("functions.h:2", "h", "{}")]


def test_k3_argument_types_are_lenient(toks):
    """A value that does not match its declared type does not fail the call: JSON is read as what it is, text
    that is not JSON is kept as a string, an argument without a type is a string (vLLM's kimi_k3 parser)."""
    tok = toks["k3"]
    arguments = [('key="n" type="number"', "seven"), ('key="s" type="string"', "7"), ('key="b" type="boolean"', "1"),
                 ('key="o" type="object"', "[1, 2]"), ('key="t"', "no type"), ('key="x" type="number"', "3.5")]
    parsed = parsed_both_ways(tok, "k3", answer_prefix(tok, "k3") + tool_section(tok, "k3", k3_call(tok, "f", arguments)))
    assert parsed.tool_call_parse_failures == 0
    (call,) = parsed.tool_calls
    assert json.loads(call["function"]["arguments"]) == {"n": "seven", "s": "7", "b": 1, "o": [1, 2], "t": "no type", "x": 3.5}


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_special_token_look_alikes_stay_text(toks, family):
    """Marker strings the model spelled with ordinary tokens are text, in reasoning and in content."""
    tok = toks[family]
    look = tok.encode("<|tool_calls_section_begin|></think><|close|>think<|sep|>")
    parsed = parsed_both_ways(tok, family, look + answer_prefix(tok, family)[1:] + look)
    text = tok.decode(look)
    assert parsed.reasoning_content == text and parsed.content == text and parsed.tool_calls == []


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_tool_calls_stream_as_they_are_generated(toks, family):
    """A call opens (id and name) as soon as its name is read, before any argument token; its arguments arrive
    piece by piece while it is generated (a string value escaped as it comes); it ends "done" at its close, the
    pieces adding up to the message's arguments."""
    tok = toks[family]
    text = 'line one\n"quoted" \\ and more words'
    if family == "k3":
        call = k3_call(tok, "f", [('key="q" type="string"', text), ('key="n" type="integer"', "12")])
        want = json.dumps({"q": text, "n": 12}, ensure_ascii=False)
    else:
        want = json.dumps({"q": text, "n": 12})
        call = k2_call(tok, "functions.f:0", f" {want}\n")
    prefix = answer_prefix(tok, family) + tool_section(tok, family, [], close=False)
    ids = prefix + call
    parser = OutputParser(tok, family, starts_in_reasoning=True, first_call_index=3)
    parser.feed(prefix)
    deltas = [parser.feed([t]) for t in call]
    pieces = [(step, p) for step, d in enumerate(deltas) for p in d.tool_calls]
    opened_at = next(step for step, p in pieces if p.id is not None)
    first_args = next(step for step, p in pieces if p.arguments)
    ended_at = next(step for step, p in pieces if p.end is not None)
    assert opened_at <= first_args and sum(1 for _, p in pieces if p.arguments) > 3 and ended_at == len(call) - 1
    assert pieces[0][1].id == ("functions.f:3" if family == "k3" else "functions.f:0") and pieces[0][1].name == "f"
    assert pieces[-1][1].end == "done"
    (whole,) = parser.finish().tool_calls
    assert whole["function"]["arguments"] == want == "".join(p.arguments for _, p in pieces)
    assert whole["id"] == pieces[0][1].id
    assert parsed_both_ways(tok, family, ids).tool_calls[0]["function"]["arguments"] == want


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_a_streamed_call_that_fails_ends_failed_before_its_text(toks, family):
    """A call opened in the stream that turns out not to parse ends "failed" and its text follows as content (the
    message's content holds it; its tool_calls do not); a later call gets an id of its own."""
    tok = toks[family]
    s = tok.encode_special
    if family == "k3":
        bad = [s("<|open|>"), *tok.encode('call tool="f" index="1"'), s("<|sep|>"), s("<|open|>"), *tok.encode("argument"),
               s("<|sep|>"), *tok.encode("7"), s("<|close|>"), *tok.encode("argument"), s("<|sep|>"),
               s("<|close|>"), *tok.encode("call"), s("<|sep|>")]  # an argument without a key
        good = k3_call(tok, "f", [('key="a" type="number"', "1")])
    else:
        bad = [s("<|tool_call_begin|>"), *tok.encode("functions.f:0"), s("<|tool_call_argument_begin|>"), *tok.encode('{"a"'),
               s("<|im_middle|>"), *tok.encode("1}"), s("<|tool_call_end|>")]  # a marker out of place
        good = k2_call(tok, "functions.f:1", '{"a": 1}')
    parser = OutputParser(tok, family, starts_in_reasoning=False)
    deltas = [parser.feed(tool_section(tok, family, [], close=False))] + [parser.feed([t]) for t in bad + good]
    msg = parser.finish()
    done, failed = streamed_calls(deltas)
    assert done == msg.tool_calls and len(failed) == 1 and msg.tool_call_parse_failures == 1
    assert failed[0]["id"] != done[0]["id"]
    end = next(d for d in deltas if any(p.end == "failed" for p in d.tool_calls))
    assert [k for k, _ in end.parts] == ["tool_call", "content"] and end.content == msg.content == tok.decode(bad)


def test_the_next_turn_numbers_its_calls_past_every_id_of_the_conversation():
    """K3 numbers a turn's calls from `calls_before`: past the highest `functions.NAME:N` of the conversation (a turn
    whose failed call took :0 has only :1 among its tool_calls), else the count of its calls (ids of other forms)."""
    from moe_export.runtime.processor import calls_before

    def turn(*ids):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}

    user = {"role": "user", "content": "q"}
    assert calls_before([user, turn("functions.f:1")]) == 2
    assert calls_before([user, turn("functions.f:0", "functions.f:1"), turn("functions.g:2")]) == 3
    assert calls_before([user, turn("call_a", "call_b")]) == 2 and calls_before([user]) == 0

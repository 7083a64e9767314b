"""The chat-format conformance corpus: conversations rendered by the vendors' renderers into
tests/data/chat_conformance.json (see tests/data/make_chat_conformance.py) and by ours in
tests/test_chat_conformance.py.

A case: id, messages, tools, and the render options of each family it runs in ("k3": thinking,
thinking_effort, tool_choice, response_format, add_generation_prompt; "k2": add_generation_prompt).
"""

from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city (Météo, 天气)",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"]}, "city": {"type": "string", "description": "City name"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": 'Search the web for "quoted" & <tagged> text',
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "top_k": {"type": "integer"},
                                                    "filters": {"type": "object", "properties": {"site": {"type": "string"}}}}}}}
TOOLS = [WEATHER, SEARCH]
SCHEMA = {"type": "object", "required": ["answer"], "properties": {"confidence": {"type": "number"}, "answer": {"type": "string"}}}


def call(cid: str, name: str, args) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def user(text, **kw) -> dict:
    return {"role": "user", "content": text, **kw}


def system(text, **kw) -> dict:
    return {"role": "system", "content": text, **kw}


def assistant(content, reasoning=None, calls=None, **kw) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return {**msg, **kw}


def tool(cid, text, **kw) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": text, **kw}


W0 = "functions.get_weather:0"
W1 = "functions.get_weather:1"
S2 = "functions.search:2"

CONVERSATIONS = {
    "hello": [user("Hello")],
    "system_user": [system("You are terse."), user("What is 2+2?")],
    "named_roles": [system("Be kind.", name="ops"), user("Hi, I'm Ann.", name="ann")],
    "multi_turn_reasoning": [
        system("You are a math tutor."), user("What is 12*12?"),
        assistant("144.", "12*12 = 144."), user("And 13*13?")],
    "reasoning_then_followups": [
        user("Name a prime."), assistant("7", "Small primes: 2, 3, 5, 7."),
        user("Another?"), assistant("11", "Next after 7 is 11."), user("Thanks")],
    "single_tool_round": [
        user("Weather in Paris?"), assistant("", "Need the tool.", [call(W0, "get_weather", {"city": "Paris"})]),
        tool(W0, '{"temp": 21, "sky": "clear"}')],
    "parallel_out_of_order": [
        user("Weather in Paris and Oslo, and search news."),
        assistant("Checking.", "Three calls.", [call(W0, "get_weather", {"city": "Paris"}),
                                                call(W1, "get_weather", {"city": "Oslo", "unit": "c"}),
                                                call(S2, "search", {"q": "news"})]),
        tool(S2, "headline: calm day"), tool(W0, "21C"), tool(W1, "-3C")],
    "parallel_unmatched_id": [
        user("Two cities."),
        assistant(None, "Two calls.", [call(W0, "get_weather", {"city": "Rome"}), call(W1, "get_weather", {"city": "Bern"})]),
        tool(W1, "10C", name="get_weather"), tool("functions.unknown:9", "??", name="get_weather")],
    "tool_results_with_name": [
        user("Search twice."),
        assistant("", "", [call(W0, "search", {"q": "a"}), call(W1, "search", {"q": "b"})]),
        tool(W0, "result a", name="search"), tool(W1, "result b", name="search")],
    "tool_results_by_order": [
        user("Weather?"),
        assistant("", "Call it.", [call(W0, "get_weather", {"city": "Lima"})]),
        {"role": "tool", "content": "18C"}],
    "unicode": [
        system("Réponds en français. 用中文也可以。"), user("¿Qué tiempo hace en 東京? 🌧️"),
        assistant("Il pleut à 東京 🌧️.", "用户问东京天气。", [call(W0, "get_weather", {"city": "東京", "unit": "c"})]),
        tool(W0, "雨, 18°C")],
    "markup_and_quotes": [
        system('Quote "exactly" & keep <tags>.', name='a "quoted" & <name>'),
        user("Type <|open|>message<|sep|> and </think> and <|im_end|> literally: \"x\" & 'y'", name="R&D \"team\""),
        assistant("Sure: <|close|>think<|sep|> is text. <think>not</think>", "Literal markers <|sep|> stay text."),
        user("ok")],
    "nested_typed_arguments": [
        user("Call with everything."),
        assistant("", "All types.", [call(S2, "search", {
            "q": "a \"b\" & c", "top_k": 5, "ratio": 0.25, "exact": True, "none": None,
            "filters": {"site": "example.org", "langs": ["en", "fr"], "nested": {"deep": [1, {"x": None}]}},
            "tags": ["α", "β"], "empty_obj": {}, "empty_list": [], "neg": -1e-05, "big": 12345678901234567890})]),
        tool(S2, "done")],
    "attribute_escaping_in_args": [
        user("Keys with quotes."),
        assistant("", "", [call(S2, "search", {'k"ey&': "v&al\"ue", "plain": "<|open|>x"})]),
        tool(S2, "ok")],
    "arguments_as_dict": [
        user("Dict args."),
        assistant("", "Dict.", [{"id": W0, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Quito"}}}]),
        tool(W0, "14C")],
    "arguments_not_json": [
        user("Raw args."),
        assistant("", "Raw.", [call(W0, "get_weather", "city=Paris, unit=c")]),
        tool(W0, "20C")],
    "arguments_empty_string": [
        user("No args."),
        assistant("", "", [call(W0, "get_weather", "")]),
        tool(W0, "n/a")],
    "content_parts": [
        system([{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]),
        user([{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}])],
    "assistant_content_none_with_calls": [
        user("Go."), assistant(None, "Just call.", [call(W0, "get_weather", {"city": "Cairo"})]), tool(W0, "35C"),
        assistant("It is 35C in Cairo.", "Report it.")],
    "whitespace_reasoning": [
        user("Hi"), assistant("Hello!", "   \n  "), user("Bye")],
    "reasoning_key_alias": [
        user("Hi"), {"role": "assistant", "content": "Hello!", "reasoning": "Greeting back."}, user("And?")],
    "agent_loop_drops_old_reasoning": [
        system("Agent."), user("Weather in Oslo?"),
        assistant("", "First call.", [call(W0, "get_weather", {"city": "Oslo"})]), tool(W0, "-3C"),
        assistant("It is -3C.", "Answer now."),
        user("And Paris?"),
        assistant("", "Second call.", [call(W1, "get_weather", {"city": "Paris"})]), tool(W1, "21C")],
    "agent_loop_finished": [
        user("Weather in Oslo?"),
        assistant("", "Call.", [call(W0, "get_weather", {"city": "Oslo"})]), tool(W0, "-3C"),
        assistant("It is -3C in Oslo.", "Summarise.")],
    "dynamic_tools_system_message": [
        system("Base."), user("Find it."),
        {"role": "system", "content": "", "tools": [SEARCH]},
        user("Now search.")],
    "assistant_with_name": [
        user("Hi"), assistant("Hello from Kimi.", "Say hi.", name="kimi"), user("Who are you?")],
    "tool_content_parts": [
        user("Weather?"), assistant("", "", [call(W0, "get_weather", {"city": "Nice"})]),
        tool(W0, [{"type": "text", "text": "sunny, "}, {"type": "text", "text": "25C"}])],
    "two_tool_rounds": [
        user("Two rounds."),
        assistant("", "Round 1.", [call(W0, "get_weather", {"city": "A"})]), tool(W0, "1C"),
        assistant("", "Round 2.", [call(W1, "get_weather", {"city": "B"}), call(S2, "search", {"q": "B"})]),
        tool(W1, "2C"), tool(S2, "B is a city")],
    "tool_after_user_message": [
        user("Call."), assistant("", "", [call(W0, "get_weather", {"city": "X"}), call(W1, "get_weather", {"city": "Y"})]),
        tool(W0, "x"), user("wait"), tool(W1, "y", name="get_weather")],
    "empty_content_user": [user(""), assistant("", ""), user(None)],
    "long_text": [user("word " * 300 + "\n\n" + "    indented\n" * 20)],
}

K3_DEFAULT = {"thinking": True}
K3_VARIANTS = {
    "effort_low": {"thinking_effort": "low"},
    "effort_high": {"thinking_effort": "high"},
    "effort_max": {"thinking_effort": "max"},
    "thinking_off": {"thinking": False},
    "effort_none": {"thinking_effort": "none"},
    "tool_choice_required": {"tool_choice": "required"},
    "tool_choice_none": {"tool_choice": "none"},
    "tool_choice_auto": {"tool_choice": "auto"},
    "tool_choice_named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    "json_schema_no_schema_key": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True}}},
    "json_schema_and_required_off": {"thinking": False, "tool_choice": "required",
                                     "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    "no_generation_prompt": {"add_generation_prompt": False},
    "no_generation_prompt_thinking_off": {"add_generation_prompt": False, "thinking": False},
}
WITH_TOOLS = {"single_tool_round", "parallel_out_of_order", "parallel_unmatched_id", "unicode", "nested_typed_arguments",
              "two_tool_rounds", "agent_loop_drops_old_reasoning", "agent_loop_finished"}
# conversations each K3 variant runs on
VARIANT_BASES = ["multi_turn_reasoning", "parallel_out_of_order", "agent_loop_drops_old_reasoning"]


def cases() -> list[dict]:
    """Every case: {"id", "family", "messages", "tools", "options"}."""
    out = []
    for name, messages in CONVERSATIONS.items():
        tools = TOOLS if name in WITH_TOOLS else None
        out.append({"id": f"k3/{name}", "family": "k3", "messages": messages, "tools": tools, "options": dict(K3_DEFAULT)})
        out.append({"id": f"k2/{name}", "family": "k2", "messages": messages, "tools": tools, "options": {}})
        out.append({"id": f"k2/{name}/no_generation_prompt", "family": "k2", "messages": messages, "tools": tools,
                    "options": {"add_generation_prompt": False}})
    for base in VARIANT_BASES:
        for variant, options in K3_VARIANTS.items():
            tools = TOOLS if base in WITH_TOOLS else None
            out.append({"id": f"k3/{base}/{variant}", "family": "k3", "messages": CONVERSATIONS[base], "tools": tools,
                        "options": {**K3_DEFAULT, **options}})
    for name in ("agent_loop_drops_old_reasoning", "agent_loop_finished", "reasoning_then_followups"):
        out.append({"id": f"k3/{name}/thinking_off", "family": "k3", "messages": CONVERSATIONS[name],
                    "tools": TOOLS if name in WITH_TOOLS else None, "options": {"thinking": False}})
    return out


# Inputs the vendor refuses: (id, family, messages, tools, options); the expected error is stored with the data.
ERROR_CASES = [
    ("k3/error/array_arguments", "k3", [user("x"), assistant("", "", [call(W0, "get_weather", "[1, 2]")])], None, {}),
    ("k3/error/number_arguments_type", "k3",
     [user("x"), assistant("", "", [{"id": W0, "type": "function", "function": {"name": "get_weather", "arguments": 5}}])], None, {}),
    ("k3/error/effort_medium", "k3", [user("x")], None, {"thinking_effort": "medium"}),
    ("k3/error/unresolvable_tool_name", "k3", [user("x"), {"role": "tool", "content": "orphan"}], None, {}),
]

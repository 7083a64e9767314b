"""Conversions between the served APIs and the runtime's chat messages / outputs.

Runtime chat message (what `moe_export.runtime.chat.render` takes): {"role": system|user|assistant|tool,
"content": str, "name"?, "reasoning_content"? (assistant), "tool_calls"? (assistant, OpenAI shape with
`arguments` a JSON string), "tool_call_id"? (tool)}. Reasoning and tool calls sent back by a client are
kept verbatim: they are rendered into the next prompt exactly as the model produced them (and a turn the
runtime generated, as its generated tokens). Only stored Responses turns carry `turn_ids`: messages built
from a request never do.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from contextlib import contextmanager
from typing import Any

from moe_export.common.errors import InputError
from moe_export.runtime.core.structured import check_tool_parameters
from moe_export.runtime.entrypoints.server.errors import APIError


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, text_types: tuple[str, ...]) -> str | list:
    """A message content as a string when it is only text parts; lists with other parts (images) are
    passed on unchanged for the runtime to accept or refuse."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InputError(f"{where}: content must be a string or a list of parts")
    if all(isinstance(p, dict) and p.get("type") in text_types for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    for p in content:
        if not isinstance(p, dict) or "type" not in p:
            raise InputError(f"{where}: every content part must be an object with a `type`")
    # a Responses `input_image` part is an image_url part (`runtime.images` reads either shape)
    return [{"type": "image_url", "image_url": {"url": p.get("image_url")}} if p["type"] == "input_image" else p
            for p in content]


def _arguments_string(arguments: Any, where: str) -> str:
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    raise InputError(f"{where}: function.arguments must be a JSON string or an object")


# --- OpenAI Chat Completions --------------------------------------------------------------------------

def chat_messages_from_openai(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> runtime messages (developer -> system; `reasoning` accepted as
    `reasoning_content`; text parts joined)."""
    if not messages:
        raise InputError("messages: at least one message is required")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise InputError(f"{where}.role: must be system, developer, user, assistant or tool, got {role!r}")
        msg: dict[str, Any] = {"role": role, "content": _text_of(m.get("content"), where, ("text", "input_text"))}
        if m.get("name"):
            msg["name"] = str(m["name"])
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                msg["reasoning_content"] = str(reasoning)
            if m.get("tool_calls"):
                msg["tool_calls"] = [_openai_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        if role == "tool":
            if not m.get("tool_call_id"):
                raise InputError(f"{where}: a tool message needs `tool_call_id`")
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def _openai_tool_call(call: dict, where: str) -> dict:
    fn = call.get("function") or {}
    if not fn.get("name"):
        raise InputError(f"{where}: function.name is required")
    return {
        "id": str(call.get("id") or new_id("call_")),
        "type": "function",
        "function": {"name": str(fn["name"]), "arguments": _arguments_string(fn.get("arguments", "{}"), where)},
    }


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """Validate OpenAI chat tools ({type: function, function: {name, description?, parameters?}})."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("function"), dict) or not t["function"].get("name"):
            raise InputError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        if t["function"].get("parameters") is not None:
            check_tool_parameters(t["function"]["parameters"], f"tools[{i}].function.parameters")
    return tools


def normalize_tool_choice(tool_choice: Any, tools: list[dict] | None, field: str = "tool_choice") -> str | dict | None:
    """'auto' | 'none' | 'required' | {'type': 'function', 'function': {'name': N}} (validated against tools)."""
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise InputError(f"{field}: must be auto, none, required or a named function, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise InputError(f"{field}: 'required' needs at least one tool")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if not name:
        raise InputError(f"{field}: a named choice must give the function name")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise InputError(f"{field}: function {name!r} is not among the declared tools")
    return {"type": "function", "function": {"name": name}}


def chat_completion_response(outs: list, *, request_id: str, model: str, logprob_pieces: list[list[str]] | None,
                             decode=None) -> dict:
    """ChatOutputs (one per choice) -> chat.completion object (logprob_pieces: each choice's decoded output
    tokens when logprobs were asked)."""
    choices = []
    for i, out in enumerate(outs):
        message: dict[str, Any] = {"role": "assistant", "content": out.content, "reasoning_content": out.reasoning_content}
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": out.finish_reason, "logprobs": None}
        if logprob_pieces is not None and out.logprobs is not None:
            choice["logprobs"] = chat_logprobs(logprob_pieces[i], out.logprobs, out.top_logprobs, decode)
        choices.append(choice)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": openai_usage(summed_usage(outs)),
    }


def summed_usage(outs: list) -> dict:
    """Usage of several outputs of one request (n choices, several prompts): the prompt counted once per
    distinct prompt, completions summed."""
    prompts = {tuple(o.prompt_ids): o.usage for o in outs}
    return {
        "prompt_tokens": sum(u["prompt_tokens"] for u in prompts.values()),
        "completion_tokens": sum(o.usage["completion_tokens"] for o in outs),
        "reasoning_tokens": sum(o.usage.get("reasoning_tokens", 0) for o in outs),
        "cached_tokens": sum(u.get("cached_tokens", 0) for u in prompts.values()),
    }


OPENAI_EFFORTS = {"minimal": "low", "medium": "high", "xhigh": "max"}


def openai_effort(effort):
    """OpenAI's reasoning efforts onto the model's tiers (low / high / max, none, or a token count): minimal ->
    low, medium -> high, xhigh -> max (the nearest tier at or above); the others pass through."""
    return OPENAI_EFFORTS.get(effort, effort) if isinstance(effort, str) else effort


def chat_logprobs(pieces: list[str], logprobs: list[float], top: list | None = None, decode=None) -> dict:
    """OpenAI's logprobs.content: each output token with its logprob and its most likely alternatives
    (`top`: per token, (token id, logprob) pairs; `decode`: token id -> text)."""
    top = top or [[] for _ in pieces]

    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(decode(i), alt) for i, alt in alts]}
                        for t, lp, alts in zip(pieces, logprobs, top)]}


def openai_usage(usage: dict) -> dict:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
        "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
    }


# --- OpenAI Responses ---------------------------------------------------------------------------------

def responses_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools ({type: function, name, parameters}) -> chat tools."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not t.get("name"):
            raise InputError(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are served")
        fn = {"name": t["name"]}
        if t.get("description"):
            fn["description"] = t["description"]
        if t.get("parameters") is not None:
            check_tool_parameters(t["parameters"], f"tools[{i}].parameters")
            fn["parameters"] = t["parameters"]
        out.append({"type": "function", "function": fn})
    return out


def responses_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | dict | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "function" not in tool_choice:
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return normalize_tool_choice(tool_choice, tools)


def messages_from_responses_input(items: str | list[dict]) -> list[dict]:
    """Responses input items -> runtime messages. Consecutive reasoning / assistant message /
    function_call items form one assistant message; function_call_output becomes a tool message."""
    return responses_messages_with_origins(items)[0]


def responses_messages_with_origins(items: str | list[dict]) -> tuple[list[dict], list[str]]:
    """(runtime messages, the input item each one came from: `input` or `input[i]`), see
    `messages_from_responses_input`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict] = []
    origins: list[str] = []
    assistant: dict | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind in ("reasoning", "function_call") or kind == "message" and item.get("role") == "assistant":
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                out.append(assistant)
                origins.append(where)
            _add_assistant_item(assistant, item, kind, where)
            continue
        assistant = None
        out.append(_responses_user_item(item, kind, where))
        origins.append(where)
    return out, origins


def _add_assistant_item(a: dict, item: dict, kind: str, where: str) -> None:
    if kind == "message":
        a["content"] += _text_of(item.get("content"), where, ("output_text", "input_text", "text"))
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        a["reasoning_content"] = a.get("reasoning_content", "") + "".join(str(p.get("text", "")) for p in parts)
    else:
        if not item.get("name") or not item.get("call_id"):
            raise InputError(f"{where}: a function_call item needs `name` and `call_id`")
        a.setdefault("tool_calls", []).append({
            "id": str(item["call_id"]), "type": "function",
            "function": {"name": str(item["name"]), "arguments": _arguments_string(item.get("arguments", "{}"), where)},
        })


def _responses_user_item(item: dict, kind: str, where: str) -> dict:
    if kind == "function_call_output":
        if not item.get("call_id"):
            raise InputError(f"{where}: a function_call_output item needs `call_id`")
        output = item.get("output", "")
        if not isinstance(output, str):
            output = _text_of(output, where, ("input_text", "output_text", "text"))
        return {"role": "tool", "tool_call_id": str(item["call_id"]), "content": output}
    if kind != "message":
        raise InputError(f"{where}.type: {kind!r} is not served (message, reasoning, function_call, function_call_output)")
    role = item.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user"):
        raise InputError(f"{where}.role: must be user, system, developer or assistant, got {role!r}")
    return {"role": role, "content": _text_of(item.get("content"), where, ("input_text", "text"))}


@contextmanager
def user_field_names(origins: list[str], renames: dict[str, str]):
    """Errors raised inside name the fields the client wrote: `messages[k]` becomes `origins[k]` (e.g. a Responses
    `input[i]`), and each key of `renames` at the start of a field name its value (`response_format` ->
    `text.format`)."""
    def spelled(text: str) -> str:
        text = re.sub(r"\bmessages\[(\d+)\]", lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], text)
        for internal, shown in renames.items():
            text = re.sub(rf"\b{re.escape(internal)}\b", shown, text)
        return text

    try:
        yield
    except InputError as exc:
        raise InputError(spelled(str(exc))) from None
    except APIError as exc:
        raise APIError(exc.status, spelled(exc.message), spelled(exc.param) if exc.param else exc.param) from None


def responses_input_items(items: list, response_id: str) -> list[dict]:
    """A stored turn's input items as the Responses API lists them (input_items): each with an id, message
    content as parts (a string becomes one input_text part), status completed."""
    out = []
    for i, item in enumerate(items):
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", f"{'msg' if kind == 'message' else 'item'}_{response_id.removeprefix('resp_')}_{i}")
        item.setdefault("status", "completed")
        out.append(item)
    return out


def responses_output_items(out) -> list[dict]:
    """ChatOutput -> Responses output items: reasoning, message, function_call(s)."""
    items: list[dict] = []
    if out.reasoning_content:
        items.append({"type": "reasoning", "id": new_id("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": out.reasoning_content}], "status": "completed"})
    if out.content:
        items.append({"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": out.content, "annotations": [], "logprobs": []}]})
    for call in out.tool_calls or []:
        items.append({"type": "function_call", "id": new_id("fc_"), "call_id": call["id"], "status": "completed",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    return items


def responses_object(
    response_id: str, req, *, model: str, status: str, output: list[dict], usage: dict | None, effort: str | None,
) -> dict:
    """The Responses API `response` object."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning": {"effort": effort, "summary": None},
        "text": req.text or {"format": {"type": "text"}},
        "temperature": req.temperature if req.temperature is not None else 0.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        },
    }


def response_format_from_text(text: dict | None) -> dict | None:
    """Responses `text.format` -> a chat `response_format`."""
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict", True)}}
    return {"type": fmt.get("type")}


# --- Anthropic Messages -------------------------------------------------------------------------------

def messages_from_anthropic(system: str | list | None, messages: list[dict]) -> list[dict]:
    """Anthropic system + messages -> runtime messages: thinking blocks -> reasoning_content, tool_use ->
    tool_calls (input as a JSON string), tool_result blocks -> tool messages (before the user's text)."""
    if not messages:
        raise InputError("messages: at least one message is required")
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system", ("text",))})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InputError(f"{where}.role: must be user or assistant, got {role!r}")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InputError(f"{where}.content: must be a string or a list of content blocks")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            for j, b in enumerate(blocks):
                kind = b.get("type")
                if kind == "text":
                    msg["content"] += str(b.get("text", ""))
                elif kind == "thinking":
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking", ""))
                elif kind == "redacted_thinking":
                    raise InputError(f"{where}.content[{j}]: redacted_thinking cannot be rendered back (no decryption here)")
                elif kind == "tool_use":
                    if not b.get("id") or not b.get("name"):
                        raise InputError(f"{where}.content[{j}]: tool_use needs `id` and `name`")
                    msg.setdefault("tool_calls", []).append({
                        "id": str(b["id"]), "type": "function",
                        "function": {"name": str(b["name"]), "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)},
                    })
                else:
                    raise InputError(f"{where}.content[{j}].type: {kind!r} is not allowed in an assistant message")
            out.append(msg)
            continue
        texts: list = []
        for j, b in enumerate(blocks):
            kind = b.get("type")
            if kind == "tool_result":
                if not b.get("tool_use_id"):
                    raise InputError(f"{where}.content[{j}]: tool_result needs `tool_use_id`")
                result = _text_of(b.get("content"), f"{where}.content[{j}]", ("text",))
                out.append({"role": "tool", "tool_call_id": str(b["tool_use_id"]), "content": result})
            elif kind in ("text", "image"):
                texts.append(b)
            else:
                raise InputError(f"{where}.content[{j}].type: {kind!r} is not served (text, image, tool_result)")
        if texts:
            out.append({"role": "user", "content": _text_of(texts, where, ("text",))})
    return out


def anthropic_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic tools ({name, description?, input_schema}) -> chat tools."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not t.get("name") or t.get("type", "custom") not in ("custom",):
            raise InputError(f"tools[{i}]: only client tools ({{'name': ..., 'input_schema': ...}}) are served")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        check_tool_parameters(fn["parameters"], f"tools[{i}].input_schema")
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def anthropic_tool_choice(choice: dict | None, tools: list[dict] | None) -> str | dict | None:
    if not choice:
        return None
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise InputError(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
    return normalize_tool_choice(mapped, tools)


def anthropic_effort(thinking: dict | None) -> str | int | None:
    """`thinking: {type: enabled, budget_tokens: N}` -> numeric budget N (without a budget: the server's default
    tier); `{type: disabled}` or no `thinking` field -> 'none' (Anthropic's default is no extended thinking)."""
    if thinking is None:
        return "none"
    kind = thinking.get("type")
    if kind == "disabled":
        return "none"
    if kind in ("enabled", "adaptive"):
        budget = thinking.get("budget_tokens")
        if budget is None:
            return None
        if not isinstance(budget, int) or budget < 1:
            raise InputError(f"thinking.budget_tokens: must be a positive integer, got {budget!r}")
        return budget
    raise InputError(f"thinking.type: must be enabled or disabled, got {kind!r}")


ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_content(out) -> list[dict]:
    """ChatOutput -> content blocks: thinking, text, tool_use."""
    blocks: list[dict] = []
    if out.reasoning_content:
        blocks.append({"type": "thinking", "thinking": out.reasoning_content, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.tool_calls or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


def anthropic_usage(usage: dict) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache (the prompt is input_tokens +
    cache_creation_input_tokens + cache_read_input_tokens; nothing is billed as written to a cache here)."""
    cached = usage.get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def anthropic_stop(out) -> dict:
    """stop_reason and stop_sequence: "stop_sequence" and the matched string when a stop sequence ended it."""
    if out.stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_string}
    return {"stop_reason": ANTHROPIC_STOP[out.finish_reason], "stop_sequence": None}


def anthropic_message(out, *, message_id: str, model: str) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": anthropic_content(out),
        **anthropic_stop(out),
        "usage": anthropic_usage(out.usage),
    }

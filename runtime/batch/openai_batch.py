"""OpenAI Batch API / `vllm run-batch` JSONL: input lines to runtime requests, results to output records.

Input line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body": {...}}. Output: {"id", "custom_id", "response": {"status_code": 200,
"request_id", "body": chat.completion | text_completion | response}, "error": null}, or on failure
"response": null and "error": {"code", "message"}. Streaming bodies are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from moe_export.export.errors import InputError
from moe_export.runtime.request_options import parse_request_options

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# OpenAI body fields accepted and not acted on (batch bookkeeping, defaults we match)
IGNORED_BODY_FIELDS = ("model", "user", "metadata", "store", "n", "stream", "parallel_tool_calls", "logprobs",
                       "presence_penalty", "frequency_penalty", "stream_options", "service_tier")


def parse_input_line(line: str, line_no: int) -> dict:
    """A JSONL line -> {"custom_id", "url", "body"}; InputError naming the line when malformed."""
    where = f"input line {line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(f"{where}: custom_id must be a non-empty string")
    if record.get("method", "POST") != "POST":
        raise InputError(f"{where} ({custom_id}): method must be POST, got {record.get('method')!r}")
    if record.get("url") not in URLS:
        raise InputError(f"{where} ({custom_id}): url must be one of {', '.join(URLS)}, got {record.get('url')!r}")
    if not isinstance(record.get("body"), dict):
        raise InputError(f"{where} ({custom_id}): body must be a JSON object")
    return {"custom_id": custom_id, "url": record["url"], "body": record["body"]}


def _check_common(body: dict, where: str) -> None:
    if body.get("stream"):
        raise InputError(f"{where}: stream=true is not supported in batch")
    if body.get("n", 1) != 1:
        raise InputError(f"{where}: only n=1 is supported")
    for flag in ("presence_penalty", "frequency_penalty"):
        if body.get(flag) not in (None, 0, 0.0):
            raise InputError(f"{where}: {flag} is not supported")
    if body.get("logprobs"):
        raise InputError(f"{where}: logprobs are not supported in batch")


def _usage_chat(usage: dict) -> dict:
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }


def _responses_tools(tools: list) -> list:
    """Responses API tools ({type: function, name, parameters}) -> chat tool declarations."""
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def _responses_messages(body: dict, where: str) -> list[dict]:
    messages = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise InputError(f"{where}: input must be a string or a list of messages")
    for item in given:
        if not isinstance(item, dict) or "role" not in item:
            raise InputError(f"{where}: every input item must be a message with a role")
        content = item.get("content")
        if isinstance(content, list):  # input_text / output_text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        messages.append({"role": item["role"], "content": content})
    return messages


async def run_request(llm, item: dict) -> tuple[dict, dict]:
    """Run one parsed input line on an AsyncLLM -> (response body, usage {prompt, completion, reasoning})."""
    url, body, where = item["url"], dict(item["body"]), f"{item['custom_id']}"
    _check_common(body, where)
    created = int(time.time())
    model = body.get("model") or "moe-export"
    if url == "/v1/chat/completions":
        messages = body.pop("messages", None)
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: messages must be a non-empty list")
        if "max_completion_tokens" in body:
            body["max_tokens"] = body.pop("max_completion_tokens")
        opts = parse_request_options(body, f"{where} body", ignored=IGNORED_BODY_FIELDS)
        out = await llm.chat(messages, opts.sampling, **opts.chat_kwargs)
        message = {"role": "assistant", "content": out.content, "reasoning_content": out.reasoning_content}
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": out.finish_reason}],
            "usage": _usage_chat(out.usage),
        }, out.usage
    if url == "/v1/completions":
        prompt = body.pop("prompt", None)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise InputError(f"{where}: prompt must be a non-empty string or a list of token ids")
        for unsupported in ("echo", "suffix", "best_of"):
            if body.get(unsupported):
                raise InputError(f"{where}: {unsupported} is not supported")
            body.pop(unsupported, None)
        opts = parse_request_options(body, f"{where} body", ignored=IGNORED_BODY_FIELDS)
        if opts.chat_kwargs:
            raise InputError(f"{where}: {', '.join(sorted(opts.chat_kwargs))} apply to chat requests only")
        out = await llm.generate(prompt, opts.sampling)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}],
            "usage": _usage_chat(out.usage),
        }, out.usage
    messages = _responses_messages(body, where)
    for key in ("input", "instructions"):
        body.pop(key, None)
    if "max_output_tokens" in body:
        body["max_tokens"] = body.pop("max_output_tokens")
    reasoning = body.pop("reasoning", None)
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        body["reasoning_effort"] = reasoning["effort"]
    if isinstance(body.get("tools"), list):
        body["tools"] = _responses_tools(body["tools"])
    opts = parse_request_options(body, f"{where} body", ignored=IGNORED_BODY_FIELDS)
    out = await llm.chat(messages, opts.sampling, **opts.chat_kwargs)
    output: list[dict[str, Any]] = []
    if out.reasoning_content:
        output.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}",
                       "summary": [], "content": [{"type": "reasoning_text", "text": out.reasoning_content}]})
    if out.content:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": out.content, "annotations": []}]})
    for call in out.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = out.usage
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created, "model": model,
        "status": "completed" if out.finish_reason != "length" else "incomplete", "output": output,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)}},
    }, usage

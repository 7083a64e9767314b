"""OpenAI Chat Completions (`POST /v1/chat/completions`), whole or streamed, n choices."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.edge import answer, authorize, documented, parse, service_of
from moe_export.runtime.entrypoints.server.errors import APIError
from moe_export.runtime.entrypoints.server.protocol import ChatCompletionRequest
from moe_export.runtime.entrypoints.server.service import ChatRun, Disconnected, Service, merged

ROUTE = "/v1/chat/completions"
router = APIRouter()


@router.post(ROUTE, openapi_extra=documented(ChatCompletionRequest))
async def chat_completions_route(request: Request):
    authorize(request)
    req = await parse(request, ChatCompletionRequest)
    return answer(await chat_completion(service_of(request), req, request.is_disconnected), request.url.path)


async def chat_completion(svc: Service, req: ChatCompletionRequest, disconnected: Disconnected = None
                          ) -> dict | AsyncIterator[dict]:
    """The chat.completion object, or (stream) its chunk events."""
    model = svc.check_model(req.model)
    max_tokens = req.max_completion_tokens or req.max_tokens
    svc.check_limits(req.messages, req.tools, max_tokens)
    extras = svc.sampler_extras(req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    messages = await svc.inline_image_urls(convert.chat_messages_from_openai(req.messages))
    tools = convert.openai_tools(req.tools)
    tool_choice = convert.normalize_tool_choice(req.tool_choice, tools)
    effort = convert.openai_effort(req.reasoning_effort)
    request_id = convert.new_id("chatcmpl-")
    rendered = await svc.render(messages, tools=tools, tool_choice=tool_choice, response_format=req.response_format,
                                effort=effort)  # once for all n choices
    runs: list[ChatRun] = []
    try:
        for i in range(req.n):  # n choices: n sequences, each seeded apart (seed + i when a seed is given)
            sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            seed=None if req.seed is None else req.seed + i, stop=req.stop, logprobs=req.logprobs,
                            ignore_eos=req.ignore_eos, top_logprobs=req.top_logprobs or 0, extras=extras,
                            session={"prompt_cache_key": req.prompt_cache_key, "user": req.user})
            runs.append(await svc.run_chat(
                request_id if req.n == 1 else f"{request_id}-{i}", rendered, sampling, max_tokens=max_tokens,
                parallel=req.parallel_tool_calls,
                max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
            ))
    except BaseException:
        for run in runs:
            await run.deltas.aclose()
        raise
    if req.stream:
        return chunk_events(svc, req, runs, request_id, model)
    outs = await svc.final_outputs([r.deltas for r in runs], disconnected)
    for run, out in zip(runs, outs):
        svc.finish(ROUTE, out, run.tier)
    pieces = [[svc.decode_one(t) for t in out.output_ids] for out in outs] if req.logprobs else None
    return convert.chat_completion_response(outs, request_id=request_id, model=model, logprob_pieces=pieces,
                                            decode=svc.decode_one)


async def chunk_events(svc: Service, req: ChatCompletionRequest, runs: list[ChatRun], request_id: str,
                       model: str) -> AsyncIterator[dict]:
    """The chat.completion.chunk events of started runs, then [DONE] (with a usage chunk when asked).

    Text and tool calls stream as generated, in OpenAI's chunk format: a call's first chunk gives its index, id,
    type and function name, later ones `function.arguments` fragments. `index` counts the calls the model opened;
    a call that then does not parse (not enforced by a grammar, so only under tool_choice auto) gets no more
    chunks and is not in the final message, whose content holds its text (streamed as content after it): a client
    that joins the chunks has it among its calls with the arguments it streamed (not JSON), which the whole answer
    does not."""
    created = int(time.time())

    def chunk(index: int, delta: dict, finish_reason=None, usage=None, choices=True, logprobs=None) -> dict:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
                if choices else []}
        if usage is not None:
            body["usage"] = usage
        return {"data": json.dumps(body)}

    for i in range(len(runs)):  # content null until some arrives (as OpenAI's tool-call streams): a client joining the
        yield chunk(i, {"role": "assistant", "content": None})  # chunks gets the whole answer's null when none does
    outs = []
    async for i, d in merged([r.deltas for r in runs]):
        # the step's tokens' logprobs ride on its first chunk (an empty delta when its text is held back)
        logprobs = convert.chat_logprobs([svc.decode_one(t) for t in d.token_ids], d.logprobs, d.top_logprobs,
                                         svc.decode_one) if d.logprobs else None
        for kind, value in d.parts:
            if kind != "tool_call":
                yield chunk(i, {"reasoning_content" if kind == "reasoning" else "content": value}, logprobs=logprobs)
            elif value.id is not None or value.arguments:
                call = {"index": value.index, "function": {"arguments": value.arguments}}
                if value.id is not None:
                    call = {"index": value.index, "id": value.id, "type": "function",
                            "function": {"name": value.name, "arguments": value.arguments}}
                yield chunk(i, {"tool_calls": [call]}, logprobs=logprobs)
            else:  # a call's end: no chunk of its own
                continue
            logprobs = None
        if logprobs is not None:
            yield chunk(i, {}, logprobs=logprobs)
        if d.finished:
            out = d.output
            outs.append(out)
            svc.finish(ROUTE, out, runs[i].tier)
            yield chunk(i, {}, out.finish_reason)
    if (req.stream_options or {}).get("include_usage"):
        yield chunk(0, {}, usage=convert.openai_usage(convert.summed_usage(outs)), choices=False)
    yield {"data": "[DONE]"}

"""OpenAI (legacy) Completions (`POST /v1/completions`): a string, strings, token ids or lists of them; n
choices per prompt; echo; logprobs with alternatives; whole or streamed."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.edge import answer, authorize, documented, parse, service_of
from moe_export.runtime.entrypoints.server.errors import APIError
from moe_export.runtime.entrypoints.server.protocol import CompletionRequest
from moe_export.runtime.entrypoints.server.service import MAX_CHOICES, Disconnected, Service, merged

ROUTE = "/v1/completions"
router = APIRouter()


@router.post(ROUTE, openapi_extra=documented(CompletionRequest))
async def completions_route(request: Request):
    authorize(request)
    req = await parse(request, CompletionRequest)
    return answer(await completion(service_of(request), req, request.is_disconnected), request.url.path)


async def completion(svc: Service, req: CompletionRequest, disconnected: Disconnected = None
                     ) -> dict | AsyncIterator[dict]:
    """The text_completion object, or (stream) its events."""
    model = svc.check_model(req.model)
    svc.check_limits(None, None, req.max_tokens)
    extras = svc.sampler_extras(req)
    prompts = await svc.off_loop(completion_prompts, svc, req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"prompt: {len(prompts)} prompts x n={req.n} is over the limit of {MAX_CHOICES} choices", "prompt")
    request_id = convert.new_id("cmpl-")
    streams = []
    try:
        for p_index, ids in enumerate(prompts):
            max_tokens = svc.fit_max_tokens(len(ids), req.max_tokens, "max_tokens")
            for j in range(req.n):  # choice index p_index * n + j, as vLLM orders them
                k = p_index * req.n + j
                opts = svc.request_options(req.temperature, req.top_p, req.top_k,
                                           None if req.seed is None else req.seed + j, max_tokens, req.stop,
                                           req.logprobs is not None, req.ignore_eos, top_logprobs=req.logprobs or 0,
                                           extras=extras, session={"user": req.user})
                svc.check_queue()
                rid = request_id if len(prompts) * req.n == 1 else f"{request_id}-{k}"
                request = svc.llm.processor.generate(ids, opts.sampling, rid)
                request.session = opts.session
                streams.append((await svc.timed(svc.llm.stream(request)))[1])
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    echoes = [svc.tokenizer.decode(ids) if req.echo else "" for ids in prompts for _ in range(req.n)]
    shape = CompletionShape(request_id, model)
    if req.stream:
        return completion_events(svc, req, streams, echoes, shape)
    outs = await svc.final_outputs(streams, disconnected)
    for out in outs:
        svc.finish(ROUTE, out, "none")
    choices = [shape.choice(i, echoes[i] + svc.visible_text(out.text), out.finish_reason) for i, out in enumerate(outs)]
    if req.logprobs is not None:
        for c, out, echo in zip(choices, outs, echoes):
            c["logprobs"] = completion_logprobs(svc, out.output_ids, out.logprobs, out.top_logprobs, len(echo))[0]
    return shape.body(choices, convert.openai_usage(convert.summed_usage(outs)))


class CompletionShape:
    """The text_completion objects of one request."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model

    def body(self, choices: list[dict], usage=None) -> dict:
        b = {"id": self.request_id, "object": "text_completion", "created": int(time.time()), "model": self.model,
             "choices": choices}
        if usage is not None:
            b["usage"] = usage
        return b

    @staticmethod
    def choice(i: int, text: str, finish_reason) -> dict:
        return {"index": i, "text": text, "finish_reason": finish_reason, "logprobs": None}


async def completion_events(svc: Service, req: CompletionRequest, streams: list, echoes: list[str],
                            shape: CompletionShape) -> AsyncIterator[dict]:
    offsets = [len(echo) for echo in echoes]  # each choice's text_offset so far
    for i, echo in enumerate(echoes):
        if echo:
            yield {"data": json.dumps(shape.body([shape.choice(i, echo, None)]))}
    outs = []
    async for i, d in merged(streams):
        text = svc.visible_text(d.text)
        if d.logprobs:  # the step's tokens with their logprobs, even when their text is held back
            c = shape.choice(i, text, None)
            c["logprobs"], offsets[i] = completion_logprobs(svc, d.token_ids, d.logprobs, d.top_logprobs, offsets[i])
            yield {"data": json.dumps(shape.body([c]))}
        elif text:
            yield {"data": json.dumps(shape.body([shape.choice(i, text, None)]))}
        if d.finished:
            outs.append(d.output)
            svc.finish(ROUTE, d.output, "none")
            yield {"data": json.dumps(shape.body([shape.choice(i, "", d.output.finish_reason)]))}
    if (req.stream_options or {}).get("include_usage"):
        yield {"data": json.dumps(shape.body([], convert.openai_usage(convert.summed_usage(outs))))}
    yield {"data": "[DONE]"}


def completion_logprobs(svc: Service, ids: list[int], logprobs, top_logprobs, offset: int) -> tuple[dict, int]:
    """The completions API's logprobs of output tokens `ids` (all of an answer, or a streamed step's): each
    token's text (special tokens by name), logprob, its most likely alternatives ({text: logprob}) and its
    offset in the returned text, which starts at `offset`; and the offset after them."""
    tokens, offsets = [], []
    for t in ids:
        piece = svc.decode_one(t)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(svc.visible_text(piece))
    tops = top_logprobs or [[] for _ in tokens]
    return {"tokens": tokens, "token_logprobs": [float(lp) for lp in logprobs or []],
            "top_logprobs": [top_entries(svc, alts) for alts in tops], "text_offset": offsets}, offset


def top_entries(svc: Service, alternatives: list[tuple[int, float]]) -> dict[str, float]:
    """{text: logprob} of a token's most likely alternatives; one whose text an earlier (likelier) one already
    has is keyed `token_id:ID` (vLLM's spelling of a token by id), so no alternative is lost."""
    entries: dict[str, float] = {}
    for token_id, logprob in alternatives:
        text = svc.decode_one(token_id)
        entries[text if text not in entries else f"token_id:{token_id}"] = float(logprob)
    return entries


def completion_prompts(svc: Service, prompt) -> list[list[int]]:
    """A completions `prompt` (a string, a list of strings, a token-id list or a list of them) as token-id
    lists, one per prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: give a string, a list of strings, a list of token ids or a list of them", "prompt")
    out = []
    for i, p in enumerate(prompt):
        ids = svc.tokenizer.encode(p) if isinstance(p, str) else list(p)
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not ids:
            raise APIError(400, f"{where}: the prompt is empty", "prompt")
        svc.check_token_ids(ids, where, "prompt")
        out.append(ids)
    return out

"""The small routes: /health, /metrics, /version, /v1/models (and one model), vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from moe_export.runtime.entrypoints.server import convert
from moe_export.runtime.entrypoints.server.edge import authorize, documented, parse, service_of
from moe_export.runtime.entrypoints.server.errors import APIError, shown
from moe_export.runtime.entrypoints.server.protocol import DetokenizeRequest, TokenizeRequest
from moe_export.runtime.entrypoints.server.service import Service
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 while the engine core runs; 503 once it died (the server is exiting so that its supervisor restarts it)."""
    svc = service_of(request)
    if svc.healthy:
        return {"status": "ok"}
    error = svc.llm.fatal_error
    return JSONResponse({"status": "engine_dead", "error": str(error) if error is not None else "the engine core stopped"},
                        status_code=503)


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(service_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(svc: Service, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "moe-export", "root": str(svc.settings.engine_dir),
            "max_model_len": svc.info.max_seq_len}


@router.get("/v1/models")
async def models(request: Request):
    authorize(request)
    svc = service_of(request)
    svc.metrics.requests.labels("/v1/models", "200").inc()
    return {"object": "list", "data": [model_card(svc, n) for n in svc.settings.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    authorize(request)
    svc = service_of(request)
    if model_id not in svc.settings.served_model_names:
        raise APIError(404, f"The model `{shown(model_id)}` does not exist.", "model")
    svc.metrics.requests.labels("/v1/models/{id}", "200").inc()
    return model_card(svc, model_id)


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("moe-export")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@router.post("/tokenize", openapi_extra=documented(TokenizeRequest))
async def tokenize(request: Request):
    authorize(request)
    req = await parse(request, TokenizeRequest)
    svc = service_of(request)
    svc.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` or `messages`")
    if req.prompt is not None:
        ids = await svc.off_loop(svc.tokenizer.encode, req.prompt)
    else:
        svc.check_limits(req.messages, req.tools, None)
        ids = (await svc.off_loop(
            svc.llm.processor.render, convert.chat_messages_from_openai(req.messages),
            tools=convert.openai_tools(req.tools), reasoning_effort=convert.openai_effort(req.reasoning_effort),
            add_generation_prompt=req.add_generation_prompt,
            tool_choice=convert.normalize_tool_choice(req.tool_choice, req.tools), response_format=req.response_format,
        )).prompt_ids
    svc.metrics.requests.labels("/tokenize", "200").inc()
    return {"count": len(ids), "max_model_len": svc.info.max_seq_len, "tokens": ids}


@router.post("/detokenize", openapi_extra=documented(DetokenizeRequest))
async def detokenize(request: Request):
    authorize(request)
    req = await parse(request, DetokenizeRequest)
    svc = service_of(request)
    svc.check_model(req.model)
    svc.check_token_ids(req.tokens, "tokens", "tokens")
    svc.metrics.requests.labels("/detokenize", "200").inc()
    return {"prompt": await svc.off_loop(svc.tokenizer.decode, req.tokens)}

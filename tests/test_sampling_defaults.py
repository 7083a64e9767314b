"""One set of sampling defaults: the server (OpenAI chat / completions / Responses, Anthropic messages), Triton
and batch build a request's SamplingParams over `LLM.default_sampling` (the engine's generation_config.json),
so a request without sampling fields runs the same everywhere (HTTP used to default to temperature 1, Triton
to 0). Thinking is resolved once, by the engine core: the server reports the tier the core chose."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_export.runtime.sampling import SamplingParams, with_defaults

GENERATION = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}
DOUBLE_DIR = Path(__file__).parent / "triton_backend_double"


def _defaults_of(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in GENERATION}


@pytest.fixture(scope="module")
def engine(runtime_engine, tmp_path_factory):
    """tiny-k3 with a generation_config.json that sets every default it may."""
    out = tmp_path_factory.mktemp("defaults") / "engine"
    shutil.copytree(runtime_engine("tiny-k3", 1, 1, 1), out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


def test_with_defaults_keeps_the_given_values():
    base = SamplingParams(temperature=0.6, top_k=7)
    assert with_defaults(base, temperature=None, max_tokens=3) == SamplingParams(temperature=0.6, top_k=7, max_tokens=3)
    assert with_defaults(base, temperature=0.0).temperature == 0.0  # a given 0 is kept, not replaced


def test_server_endpoints_use_the_engine_defaults_and_the_core_tier(engine):
    from moe_export.runtime.entrypoints.llm import AsyncLLM
    from moe_export.runtime.entrypoints.server.app import ServerSettings, create_app

    allm = AsyncLLM(engine, default_effort="low")
    assert _defaults_of(allm.default_sampling) == GENERATION
    seen: list[SamplingParams] = []
    chat_request, generate = allm.processor.chat_request, allm.processor.generate

    def chat_spy(rendered, sampling=None, **kw):
        seen.append(sampling)
        return chat_request(rendered, sampling, **kw)

    def generate_spy(prompt, sampling=None, *a, **kw):
        seen.append(sampling)
        return generate(prompt, sampling, *a, **kw)

    allm.processor.chat_request, allm.processor.generate = chat_spy, generate_spy
    app = create_app(allm, ServerSettings(engine, accept_any_model=True))
    user = [{"role": "user", "content": "hi"}]
    calls = [("/v1/chat/completions", {"messages": user, "max_tokens": 2}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
             ("/v1/messages", {"messages": user, "max_tokens": 2})]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.post(path, json=body) for path, body in calls]

    try:
        responses = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        assert len(seen) == 4 and all(_defaults_of(p) == GENERATION for p in seen), seen
        # a request's own value wins over the default
        seen.clear()
        calls[:] = [("/v1/chat/completions", {"messages": user, "max_tokens": 2, "temperature": 0, "top_k": 3})]
        assert asyncio.run(main())[0].status_code == 200
        assert (seen[0].temperature, seen[0].top_k, seen[0].top_p) == (0.0, 3, 0.9)
        # thinking resolved once, in the core: the tier metric counts what the core resolved (default low) for the
        # two OpenAI chat routes and the second chat; /v1/messages without `thinking` does not reason (Anthropic's
        # default)
        metrics = asyncio.run(_get(app, "/metrics")).text
        assert 'moe_export_requests_by_tier_total{tier="low"} 3.0' in metrics, metrics
        assert 'moe_export_requests_by_tier_total{tier="none"} 1.0' in metrics, metrics
    finally:
        allm.shutdown()


async def _get(app, path):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.get(path)


def test_triton_and_batch_use_the_engine_defaults(engine, tmp_path):
    from moe_export.runtime.entrypoints.batch.doc_tasks import DocJob, DocRunner
    from moe_export.runtime.entrypoints.llm import AsyncLLM
    from moe_export.runtime.entrypoints.triton.repo import write_triton_repo

    allm = AsyncLLM(engine)
    try:
        docs = DocRunner(allm, DocJob.make("summarize", None, None), allm.llm.engine.max_seq_len, asyncio.Semaphore(1))
        assert _defaults_of(docs.sampling) == GENERATION
    finally:
        allm.shutdown()
    write_triton_repo(engine, tmp_path / "repo", "kimi")
    sys.path.insert(0, str(DOUBLE_DIR))
    try:
        import triton_python_backend_utils as pb_utils
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        spec = importlib.util.spec_from_file_location("triton_defaults_model", tmp_path / "repo" / "kimi" / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cfg = text_format.Parse((tmp_path / "repo" / "kimi" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        model = module.TritonPythonModel()
        model.initialize({"model_config": json_format.MessageToJson(cfg, preserving_proto_field_name=True),
                          "model_repository": str(tmp_path / "repo" / "kimi"), "model_version": "1",
                          "model_name": "kimi", "model_instance_kind": "CPU", "model_instance_name": "kimi_0_0",
                          "model_instance_device_id": "0"})
        try:
            request = pb_utils.InferenceRequest(
                [pb_utils.Tensor("text_input", np.array([b"hi"], dtype=np.object_))], "r", None,
                declared_outputs={o.name for o in cfg.output})
            assert _defaults_of(model._parse(request)["opts"].sampling) == GENERATION
        finally:
            model.finalize()
    finally:
        sys.path.remove(str(DOUBLE_DIR))

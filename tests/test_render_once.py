"""Every front end renders a request once (`InputProcessor.render`, counted at `render_prompt`): the server's chat
completions (n choices included), Responses and Anthropic messages routes, batch's endpoint lines and document
tasks (`AsyncLLM.chat`, eval's path too) and `LLM.chat`; the Triton model: test_triton_repo.py. Before the input
processor the server rendered a chat twice per choice (its prompt length, then the stream's own rendering)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moe_export.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(runtime_engine):
    return runtime_engine("tiny-k3", 1, 1, 1)


@pytest.fixture
def renders(monkeypatch) -> list:
    """The conversations rendered (one entry per `render_prompt` call)."""
    import moe_export.runtime.processor as processor

    calls: list = []
    real = processor.render_prompt

    def counting(tokenizer, messages, **kwargs):
        calls.append(messages)
        return real(tokenizer, messages, **kwargs)

    monkeypatch.setattr(processor, "render_prompt", counting)
    return calls


MESSAGES = [{"role": "user", "content": "hello"}]


def test_server_routes_render_each_request_once(engine, renders):
    from serve_support import InProcessServer

    server = InProcessServer(engine, default_effort="low")
    try:
        model = server.settings.model_name
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": MESSAGES, "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
        assert len(renders) == 1
        r = httpx.post(f"{server.url}/v1/responses", timeout=120,
                       json={"model": model, "input": "hello", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(renders) == 2
        r = httpx.post(f"{server.url}/v1/messages", timeout=120,
                       json={"model": model, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(renders) == 3
        # the prompt length the server checks is the rendered ids' length (one token over the context: 400)
        ids = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": MESSAGES}).json()["tokens"]
        limit = server.llm.llm.engine.max_seq_len
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": MESSAGES, "max_tokens": limit - len(ids) + 1})
        assert r.status_code == 400 and f"{len(ids)} in the prompt" in r.text, r.text
    finally:
        server.stop()
        server.llm.shutdown()


def test_batch_and_in_process_clients_render_each_request_once(engine, renders):
    from moe_export.runtime.client.async_llm import AsyncLLM
    from moe_export.runtime.client.llm import LLM
    from moe_export.runtime.entrypoints.batch.openai_batch import ServedEndpoints

    async def run(allm: AsyncLLM) -> None:
        endpoints = ServedEndpoints(allm, engine, concurrency=4)
        try:
            status, _, body = await endpoints.post("/v1/chat/completions",
                                                   {"model": "m", "messages": MESSAGES, "max_tokens": 2, "n": 2})
            assert status == 200 and len(body["choices"]) == 2, body
            assert len(renders) == 1
            out = await allm.chat(MESSAGES, SamplingParams(max_tokens=2))  # batch's document tasks, eval
            assert out.finish_reason in ("stop", "length") and len(renders) == 2
        finally:
            await endpoints.aclose()

    allm = AsyncLLM(engine, default_effort="low")
    try:
        asyncio.run(run(allm))
    finally:
        allm.shutdown()
    llm = LLM(engine, default_effort="low")
    try:
        llm.chat([MESSAGES, MESSAGES], SamplingParams(max_tokens=2))
        assert len(renders) == 4
    finally:
        llm.shutdown()

"""The server's event loop stays free while a request tokenizes, counts or renders megabytes of text: /health
answers within 100 ms meanwhile. The chat is rendered by the runtime's own renderer with a real K3 tokenizer
(the synthetic checkpoint's), as the engine renders it; no engine is needed for this."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fake_llm import FakeLLM, FakeProcessor
from moe_export.export.convert.synth import write_synthetic_tokenizer
from moe_export.runtime.chat import render_ids
from moe_export.runtime.core.budget import ThinkingPlan
from moe_export.runtime.processor import RenderedChat
from moe_export.runtime.tokenizer import load_tokenizer
from test_serve_faults import make_app

HEALTH_LIMIT_S = 0.1  # the bound on /health's answer while a big request is worked on


class RenderingProcessor(FakeProcessor):
    """The fake's processor rendering with the runtime's chat renderer."""

    def render(self, messages, *, tools=None, reasoning_effort=None, tool_choice=None, response_format=None,
               add_generation_prompt=True) -> RenderedChat:
        ids = render_ids(self.llm.tokenizer, messages, family="k3", tools=tools, thinking=False, tool_choice=tool_choice,
                         response_format=response_format, add_generation_prompt=add_generation_prompt)
        return RenderedChat(ids, [], ThinkingPlan(False, None, "none"), tools, tool_choice, response_format)


class RenderingLLM(FakeLLM):
    """FakeLLM with a real K3 tokenizer and the runtime's chat renderer."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.processor = RenderingProcessor(self)


@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_synthetic_tokenizer(folder, "k3", 4096)
    return load_tokenizer(folder)


def words(n_bytes: int) -> str:
    """About `n_bytes` of varied ASCII prose (distinct words, so the BPE has work to do)."""
    text = " ".join(f"word{i % 9973} alpha{i % 101}, beta." for i in range(n_bytes // 20))
    return text[:n_bytes]


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": words(7_000_000)}]}),
    ("/tokenize", {"prompt": words(2_600_000)}),
    ("/tokenize", {"messages": [{"role": "user", "content": words(2_600_000)}]}),
])
def test_health_answers_within_100_ms_while_a_big_request_is_worked_on(tmp_path, k3_tokenizer, path, body):
    app, _ = make_app(tmp_path, RenderingLLM(k3_tokenizer))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600) as client:
            big = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(0.05)
            waits = []
            while not big.done():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                waits.append(time.monotonic() - start)
                await asyncio.sleep(0.02)
            return await big, waits

    r, waits = asyncio.run(scenario())
    assert r.status_code == 200, r.text[:500]
    assert (r.json().get("input_tokens") or r.json().get("count")) > 100_000
    assert len(waits) >= 3, "/health was never answered while the request ran"
    assert max(waits) < HEALTH_LIMIT_S, waits

"""The HTTP edge of the server over a fake engine: bodies nested too deep are a 400, a client that leaves while
sending its body is no 500, an error never echoes a megabyte of the request, a 429 says when to retry."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_llm import FakeLLM
from test_serve_faults import CHAT, call, make_app, post


def nested(depth: int) -> bytes:
    """A chat body whose `metadata` holds arrays `depth` deep."""
    return b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {"x": ' + \
        b"[" * depth + b"]" * depth + b"}}"


@pytest.mark.parametrize("depth", [10_000, 200])
def test_json_nested_too_deep_is_a_400(tmp_path, depth):
    app, _ = make_app(tmp_path, FakeLLM())

    async def go():
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/v1/chat/completions", content=nested(depth), headers={"content-type": "application/json"})
            return r, (await client.get("/metrics")).text

    r, metrics = asyncio.run(go())
    assert r.status_code == 400, r.text
    assert "more than 128 deep" in r.json()["error"]["message"] and "Traceback" not in r.text
    assert 'status="500"' not in metrics


def test_a_body_nested_within_the_limit_is_served(tmp_path):
    app, _ = make_app(tmp_path, FakeLLM())
    body = json.loads(nested(100))
    assert post(app, "/v1/chat/completions", body).status_code == 200


def test_a_client_that_leaves_mid_body_is_not_a_500(tmp_path):
    app, _ = make_app(tmp_path, FakeLLM())
    sent: list[dict] = []

    async def go():
        messages = [{"type": "http.request", "body": b'{"messages": [{"role": "us', "more_body": True},
                    {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"5000")],
                 "client": ("127.0.0.1", 5000), "server": ("t", 80)}
        await app(scope, receive, send)
        return (await call(app, ("GET", "/metrics", None)))[0].text

    metrics = asyncio.run(go())
    assert sent[0]["status"] == 499
    assert 'moe_export_requests_total{route="/v1/chat/completions",status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics


@pytest.mark.parametrize("method, path, field, length", [("POST", "/v1/chat/completions", "model", 1 << 20),
                                                         ("POST", "/v1/messages", "model", 1 << 20),
                                                         ("GET", "/v1/models/{name}", None, 60_000),  # URLs < 64 KiB
                                                         ("GET", "/v1/responses/{name}", None, 60_000)])
def test_an_error_does_not_echo_a_megabyte_name(tmp_path, method, path, field, length):
    app, _ = make_app(tmp_path, FakeLLM())
    name = "x" * length
    body = {**CHAT, field: name} if field else None
    (r,) = asyncio.run(call(app, (method, path.format(name=name), body)))
    assert r.status_code == 404, r.text[:300]
    assert len(r.content) < 1000 and f"({length} characters)" in r.text


class QueuedLLM(FakeLLM):
    """A fake engine whose scheduler reports 3 requests waiting."""

    def stats(self) -> dict:
        return {**super().stats(), "waiting": 3}


def test_429_carries_retry_after(tmp_path):
    app, _ = make_app(tmp_path, QueuedLLM(), max_queue=2)
    r = post(app, "/v1/chat/completions", CHAT)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", (r.status_code, r.headers)
    assert r.json()["error"]["type"] == "rate_limit_error"

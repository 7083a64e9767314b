"""The serving layer over a fake AsyncLLM (no engine): edge validation of every field's range, one failing
request never failing the next, /health and the server's exit when the engine core dies, image URL downloads
off the event loop within a total deadline and a size cap, Anthropic usage and thinking defaults, and the
Responses API's field names in errors."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from fake_llm import VOCAB, FakeLLM
from moe_export.common.errors import EngineDead, InputError, RequestFailed
from moe_export.runtime.entrypoints.server.app import create_app
from moe_export.runtime.entrypoints.server.service import EngineInfo, ServerSettings
from moe_export.runtime.sampling import FLOAT32_TINY

def png_1px() -> bytes:
    """A 1x1 RGBA PNG, as Pillow writes it."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGBA", (1, 1), (255, 0, 0, 255)).save(out, "PNG")
    return out.getvalue()


PNG_1PX = png_1px()


def make_app(tmp_path, llm: FakeLLM, **settings):
    dead: list[bool] = []
    app = create_app(llm, ServerSettings(engine_dir=tmp_path, model_name="m", **settings),
                     EngineInfo(max_seq_len=4096, max_batch=4, vocab_size=VOCAB), on_engine_dead=lambda: dead.append(True))
    return app, dead


async def call(app, *requests: tuple[str, str, dict | None]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return [await client.request(method, path, json=body) for method, path, body in requests]


def post(app, path: str, body: dict) -> httpx.Response:
    return asyncio.run(call(app, ("POST", path, body)))[0]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4})])
def test_seed_is_an_unsigned_64_bit_integer(tmp_path, path, body):
    llm = FakeLLM()
    app, _ = make_app(tmp_path, llm)
    for bad in (1 << 64, -1):
        r = post(app, path, {**body, "seed": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert post(app, path, {**body, "seed": (1 << 64) - 1}).status_code == 200
    assert llm.seen[-1][1].seed == (1 << 64) - 1
    r = post(app, path, {**body, "seed": (1 << 64) - 1, "n": 2})  # choice i uses seed + i, within 64 bits
    assert r.status_code == 200 and [s.seed for _, s, _ in llm.seen[-2:]] == [(1 << 64) - 1, 0]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                                       ("/v1/messages", {"messages": CHAT["messages"], "max_tokens": 4})])
def test_sampling_values_outside_int64_or_float32_are_a_400_naming_the_field(tmp_path, path, body):
    """The runtime's one sampling validator behind every route: top_k 2^63 (which killed the engine core) is a 400
    with param top_k; top_p 1e-300 is taken as float32's smallest normal (the most likely token)."""
    llm = FakeLLM()
    app, dead = make_app(tmp_path, llm)
    r = post(app, path, {**body, "temperature": 1, "top_k": 1 << 63})
    assert r.status_code == 400 and "64-bit integer range" in r.text and "Traceback" not in r.text, r.text
    if path != "/v1/messages":  # (Anthropic's error shape has no param)
        assert r.json()["error"]["param"] == "top_k"
    r = post(app, path, {**body, "temperature": 1, "top_p": 1e-300})
    assert r.status_code == 200 and llm.seen[-1][1].top_p == FLOAT32_TINY, r.text
    assert not dead


def test_logit_bias_range_and_token_ids(tmp_path):
    app, _ = make_app(tmp_path, FakeLLM())
    for bias, field in (({"5": 1000}, "logit_bias.5"), ({"5": -100.5}, "logit_bias.5"), ({str(VOCAB): 1}, "logit_bias")):
        r = post(app, "/v1/chat/completions", {**CHAT, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(app, "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 100, "6": -100}}).status_code == 200
    r = post(app, "/v1/completions", {"prompt": [1, VOCAB], "max_tokens": 2})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("late", [False, True])
def test_a_failed_request_does_not_fail_the_next(tmp_path, late):
    llm = FakeLLM()
    llm.fail_late = late
    app, dead = make_app(tmp_path, llm)
    llm.fail_next = RequestFailed("the sampling row of this request failed")
    failed, ok, health = asyncio.run(call(app, ("POST", "/v1/chat/completions", CHAT),
                                          ("POST", "/v1/chat/completions", CHAT), ("GET", "/health", None)))
    assert failed.status_code == 500 and "RequestFailed" in failed.json()["error"]["message"]
    assert "Traceback" not in failed.text
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fg"
    assert health.status_code == 200 and not dead


def test_dead_engine_core_makes_health_503_and_stops_the_server(tmp_path):
    llm = FakeLLM()
    app, dead = make_app(tmp_path, llm)

    async def scenario():
        inner = app.app  # inside the body-size middleware
        async with inner.router.lifespan_context(inner):
            before = (await call(app, ("GET", "/health", None)))[0]
            llm.fail_next = EngineDead("the engine step failed 3 times")
            failed = (await call(app, ("POST", "/v1/chat/completions", CHAT)))[0]
            llm.healthy, llm.fatal_error = False, EngineDead("the engine step failed 3 times")
            for _ in range(40):
                if dead:
                    break
                await asyncio.sleep(0.05)
            after = (await call(app, ("GET", "/health", None)))[0]
        return before, failed, after

    before, failed, after = asyncio.run(scenario())
    assert before.status_code == 200
    assert failed.status_code == 503 and "engine core stopped" in failed.json()["error"]["message"]
    assert after.status_code == 503 and "failed 3 times" in after.json()["error"]
    assert dead == [True]


class SlowImageServer:
    """A loopback HTTP server answering every GET with a PNG header and then `trickle` bytes every `pause`
    seconds (endless), or the whole PNG at once (pause 0); `length` overrides Content-Length."""

    def __init__(self, pause: float, length: int | None = None, body: bytes = PNG_1PX) -> None:
        self.pause, self.length, self.body = pause, length, body
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/cat.png"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            length = self.length if self.length is not None else (len(self.body) if not self.pause else 10**6)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {length}\r\n\r\n".encode())
            try:
                if not self.pause:
                    conn.sendall(self.body)
                    return
                while not self.stop.is_set():
                    conn.sendall(b"\0")
                    time.sleep(self.pause)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def image_chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 4}


def test_slow_image_download_has_a_total_deadline_and_health_stays_responsive(tmp_path):
    slow = SlowImageServer(pause=0.3)  # a byte every 0.3 s: no single read ever times out
    app, _ = make_app(tmp_path, FakeLLM(), allow_image_urls=True, allow_private_image_urls=True, image_fetch_timeout_s=2.0)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            start = time.monotonic()
            chat = asyncio.ensure_future(client.post("/v1/chat/completions", json=image_chat(slow.url)))
            await asyncio.sleep(0.3)
            waits = []
            for _ in range(5):
                t = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                waits.append(time.monotonic() - t)
                await asyncio.sleep(0.1)
            assert not chat.done()
            r = await chat
            return r, time.monotonic() - start, waits

    try:
        r, took, waits = asyncio.run(scenario())
    finally:
        slow.close()
    assert max(waits) < 0.5, waits
    assert r.status_code == 400 and "could not be fetched" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["message"].startswith("messages[0].content[1].image_url: ")
    assert 1.9 < took < 4.0


def test_image_download_size_cap_and_inlining(tmp_path):
    llm = FakeLLM()
    app, _ = make_app(tmp_path, llm, allow_image_urls=True, allow_private_image_urls=True, image_fetch_max_bytes=1000)
    big, fine = SlowImageServer(pause=0, length=5000, body=b"\0" * 5000), SlowImageServer(pause=0)
    try:
        r = post(app, "/v1/chat/completions", image_chat(big.url))
        assert r.status_code == 400 and "could not be fetched" in r.json()["error"]["message"], r.text
        assert post(app, "/v1/chat/completions", image_chat(fine.url)).status_code == 200
    finally:
        big.close()
        fine.close()
    url = llm.seen[-1][0][0]["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")  # the runtime gets the bytes, never the URL


def test_anthropic_usage_leaves_cache_reads_out_of_input_tokens(tmp_path):
    llm = FakeLLM()
    llm.cached = 16
    app, _ = make_app(tmp_path, llm)
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                          {"role": "user", "content": "again"}]}
    whole = post(app, "/v1/messages", body).json()["usage"]
    assert (whole["input_tokens"], whole["cache_read_input_tokens"], whole["cache_creation_input_tokens"]) == (14, 16, 0)
    streamed = post(app, "/v1/messages", {**body, "stream": True}).text
    delta = next(line for line in streamed.splitlines() if line.startswith("data:") and "message_delta" in line)
    assert '"input_tokens": 14' in delta and '"cache_read_input_tokens": 16' in delta


def test_anthropic_messages_without_thinking_do_not_reason(tmp_path):
    llm = FakeLLM()
    app, _ = make_app(tmp_path, llm)
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    post(app, "/v1/messages", body)
    post(app, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": 4}})
    post(app, "/v1/messages", {**body, "thinking": {"type": "enabled"}})
    assert [effort for _, _, effort in llm.seen] == ["none", 4, None]  # None: the server's default tier


def test_responses_errors_name_the_clients_fields(tmp_path):
    llm = FakeLLM()
    app, _ = make_app(tmp_path, llm)
    llm.render_error = InputError("messages[1].content[0]: not a readable image (truncated PNG data)")
    body = {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}
    r = post(app, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input[0].content[0]: "), r.text
    llm.render_error = InputError("response_format.json_schema.schema: not a valid JSON schema")
    r = post(app, "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}})
    assert r.json()["error"]["message"].startswith("text.format.schema: "), r.text


def test_completions_top_logprobs_keep_alternatives_that_decode_alike(tmp_path):
    app, _ = make_app(tmp_path, FakeLLM())
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 2})
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops == [{"f": -0.1, "token_id:31": -2.5}, {"g": -0.2, "token_id:32": -3.0}]


def test_one_metrics_label_per_route_template(tmp_path):
    app, _ = make_app(tmp_path, FakeLLM())
    asyncio.run(call(app, ("GET", "/v1/models/m", None), ("GET", "/v1/models/nope", None)))
    text = asyncio.run(call(app, ("GET", "/metrics", None)))[0].text
    labels = {line.split("route=")[1].split(",")[0] for line in text.splitlines()
              if line.startswith("moe_export_requests_total{") and "/v1/models/" in line}
    assert labels == {'"/v1/models/{id}"'}, text


@pytest.mark.parametrize("data", [b"not an image at all", PNG_1PX[:40]])
def test_image_errors_carry_no_python_reprs(data):
    from moe_export.runtime.images import decode_image

    with pytest.raises(InputError) as exc:
        decode_image(data, "messages[0].content[1]")
    message = str(exc.value)
    assert message.startswith("messages[0].content[1]: not a readable image (") and " at 0x" not in message
    assert "<_io" not in message, message


DYING_SERVER = """
import sys, threading
sys.path.insert(0, sys.argv[1])
DIES_AFTER_S = float(sys.argv[2])
from fake_llm import FakeLLM
from moe_export.common.errors import EngineDead
import moe_export.runtime.client.async_llm as llm_module

class DyingLLM(FakeLLM):
    def __init__(self, *args, **kwargs):
        super().__init__()
        threading.Timer(DIES_AFTER_S, self.die).start()

    def die(self):
        self.fatal_error, self.healthy = EngineDead("the engine step failed (injected)"), False

llm_module.AsyncLLM = DyingLLM
from moe_export.runtime.entrypoints.cli import main
sys.argv = ["moe-export", "serve", *sys.argv[3:]]
main()
"""


def test_serve_exits_1_when_the_engine_core_dies_and_keeps_the_store(tmp_path):
    import sqlite3
    import subprocess
    import sys
    from pathlib import Path

    from conftest import write_engine_config
    from serve_support import free_port, wait_ready

    write_engine_config(tmp_path)
    store, port = tmp_path / "history.sqlite", free_port()
    cmd = [sys.executable, "-c", DYING_SERVER, str(Path(__file__).parent), "3", str(tmp_path), "--port", str(port),
           "--store", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "engine core stopped" in err and "injected" in err and "Traceback" not in err
    with sqlite3.connect(store) as db:  # the store closed cleanly, with the stored turn
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0


@pytest.mark.parametrize("path,body,kind", [("/v1/chat/completions", CHAT, "data"),
                                            ("/v1/messages", {"max_tokens": 4, "messages": CHAT["messages"]}, "event")])
def test_a_request_failing_mid_stream_ends_with_an_error_event(tmp_path, path, body, kind):
    llm = FakeLLM()
    llm.fail_late, llm.fail_next = True, RequestFailed("the detokenizer of this request failed")
    app, _ = make_app(tmp_path, llm)
    r = post(app, path, {**body, "stream": True})
    lines = [line for line in r.text.splitlines() if line.startswith(("data:", "event:"))]
    assert r.status_code == 200 and "detokenizer of this request failed" in lines[-1]
    assert (lines[-2] == "event: error") if kind == "event" else lines[-1].startswith('data: {"error"')
    assert post(app, path, body).status_code == 200

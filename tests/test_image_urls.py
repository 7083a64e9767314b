"""The image URL policy (`runtime.image_urls`, the server's `--allow-image-urls`): non-public addresses refused on
every redirect hop, the connection made to the address checked, and one error text whatever went wrong.
Real HTTP servers on loopback addresses (127.0.0.1 and 127.0.0.2, both on Linux's lo)."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_llm import FakeLLM
from moe_export.common.errors import InputError
from moe_export.runtime.image_urls import ImageURLFetcher, address_allowed, fetch_image_url
from test_serve_faults import PNG_1PX, image_chat, make_app, post


class ImageSite:
    """A threaded HTTP server on `host`: /cat.png (a PNG), /cut.png (its first 40 bytes), /text (text/plain),
    /slow (never answers in time), /to?u=URL (302 to URL); anything else 404. `hosts` records the Host header of each request."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        site = self
        self.hosts: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                site.hosts.append(self.headers["Host"])
                path, _, query = self.path.partition("?")
                if path == "/to":
                    self.send_response(302)
                    self.send_header("Location", query.removeprefix("u="))
                    self.end_headers()
                    return
                if path == "/slow":
                    time.sleep(3)
                body, kind = {"/cat.png": (PNG_1PX, "image/png"), "/cut.png": (PNG_1PX[:40], "image/png"),
                              "/text": (b"hello", "text/plain"),
                              "/slow": (PNG_1PX, "image/png")}.get(path, (b"", None))
                self.send_response(200 if kind else 404)
                self.send_header("Content-Type", kind or "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def sites():
    a, b = ImageSite("127.0.0.1"), ImageSite("127.0.0.2")
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("address, public, private_ok", [
    ("8.8.8.8", True, True), ("2001:4860:4860::8888", True, True),
    ("127.0.0.1", False, True), ("10.1.2.3", False, True), ("172.16.0.1", False, True), ("192.168.1.1", False, True),
    ("169.254.1.1", False, True), ("100.64.0.1", False, True), ("0.0.0.0", False, True), ("224.0.0.1", False, True),
    ("255.255.255.255", False, True), ("240.0.0.1", False, True), ("::1", False, True), ("::", False, True),
    ("fe80::1", False, True), ("fc00::1", False, True), ("ff02::1", False, True),
    ("::ffff:127.0.0.1", False, True), ("::ffff:10.0.0.1", False, True), ("64:ff9b::7f00:1", False, True),
    ("2002:7f00:1::", False, True), ("64:ff9b::808:808", True, True),
    # cloud metadata: refused even with --allow-private-image-urls
    ("169.254.169.254", False, False), ("fd00:ec2::254", False, False), ("100.100.100.200", False, False),
    ("168.63.129.16", False, False), ("::ffff:169.254.169.254", False, False),
])
def test_address_policy(address, public, private_ok):
    ip = ipaddress.ip_address(address)
    assert address_allowed(ip) is public
    assert address_allowed(ip, allow_private=True) is private_ok


def fetch(fetcher: ImageURLFetcher, url: str) -> bytes | str:
    """The bytes fetched, or the error text."""
    async def go():
        try:
            return (await fetcher.fetch(url, "messages[0].content[1].image_url"))[0]
        except InputError as exc:
            return str(exc)
        finally:
            await fetcher.aclose()
    return asyncio.run(go())


def test_the_server_refuses_loopback_urls_by_default_with_the_one_error_text(tmp_path, sites):
    a, _ = sites
    port = a.server.server_address[1]
    app, _ = make_app(tmp_path, FakeLLM(), allow_image_urls=True, image_fetch_timeout_s=1.0)
    texts = {post(app, "/v1/chat/completions", image_chat(url)).json()["error"]["message"]
             for url in (f"{a.base}/cat.png", f"http://localhost:{port}/cat.png", f"http://[::1]:{port}/cat.png",
                         f"http://[::ffff:127.0.0.1]:{port}/cat.png", f"http://0.0.0.0:{port}/cat.png",
                         f"http://2130706433:{port}/cat.png", "http://169.254.169.254/latest/meta-data/",
                         "http://nothing.invalid/cat.png")}
    assert not a.hosts  # nothing was ever sent to the loopback server
    # opted in, the same site answers; every failure there reads exactly as a refused address does
    private, _ = make_app(tmp_path, FakeLLM(), allow_image_urls=True, allow_private_image_urls=True,
                          image_fetch_timeout_s=1.0)
    assert post(private, "/v1/chat/completions", image_chat(f"{a.base}/cat.png")).status_code == 200
    for url in (f"{a.base}/missing", f"{a.base}/text", f"{a.base}/cut.png", f"{a.base}/slow", f"http://127.0.0.1:{free_port()}/x.png",
                f"{a.base}/to?u=http://169.254.169.254/latest/meta-data/"):
        r = post(private, "/v1/chat/completions", image_chat(url))
        assert r.status_code == 400, r.text
        texts.add(r.json()["error"]["message"])
    assert len(texts) == 1, texts
    assert texts.pop().startswith("messages[0].content[1].image_url: the image URL could not be fetched")


def free_port() -> int:
    from serve_support import free_port as port

    return port()


def test_every_redirect_hop_is_checked(sites):
    a, b = sites
    only_a = {ipaddress.ip_address("127.0.0.1")}.__contains__  # a policy allowing 127.0.0.1 and nothing else
    assert fetch(ImageURLFetcher(2.0, 1 << 20, only_a), f"{a.base}/cat.png") == PNG_1PX
    assert fetch(ImageURLFetcher(2.0, 1 << 20, only_a), f"{a.base}/to?u={a.base}/cat.png") == PNG_1PX  # relative ok
    refused = fetch(ImageURLFetcher(2.0, 1 << 20, only_a), f"{a.base}/to?u={b.base}/cat.png")
    assert "could not be fetched" in refused and not b.hosts  # the hop to 127.0.0.2 was never made
    loop = fetch(ImageURLFetcher(2.0, 1 << 20, only_a), f"{a.base}/to?u=/to%3Fu=/to")  # endless redirects end
    assert "could not be fetched" in loop


def test_the_connection_goes_to_the_address_checked(sites):
    """A name that only our resolver knows (`.test` never resolves in DNS): the fetch reaches the site, so it
    connected to the address checked, sending the name as Host; a name resolving to one refused address among
    good ones is refused."""
    a, _ = sites
    port = a.server.server_address[1]
    allow = {ipaddress.ip_address("127.0.0.1")}.__contains__
    answers: list[str] = []

    async def resolve(host: str, p: int):
        answers.append(host)
        return [ipaddress.ip_address("127.0.0.1")] if host == "images.test" else \
            [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.0.0.1")]

    assert fetch(ImageURLFetcher(2.0, 1 << 20, allow, resolve), f"http://images.test:{port}/cat.png") == PNG_1PX
    assert a.hosts == [f"images.test:{port}"] and answers == ["images.test"]  # resolved once, connected there
    assert "could not be fetched" in fetch(ImageURLFetcher(2.0, 1 << 20, allow, resolve), f"http://mixed.test:{port}/cat.png")
    assert a.hosts == [f"images.test:{port}"]


def test_the_in_process_llm_path_uses_the_same_policy(sites):
    from moe_export.runtime.images import image_part_bytes

    a, _ = sites
    part = {"type": "image_url", "image_url": {"url": f"{a.base}/cat.png"}}
    with pytest.raises(InputError, match="could not be fetched"):
        image_part_bytes(part, "messages[0].content[1]", fetch_image_url)
    assert not a.hosts


def test_no_request_goes_through_an_environment_proxy(sites, monkeypatch):
    a, _ = sites
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.2:9")  # a proxy would resolve names itself
    allow = {ipaddress.ip_address("127.0.0.1")}.__contains__
    assert fetch(ImageURLFetcher(2.0, 1 << 20, allow), f"{a.base}/cat.png") == PNG_1PX

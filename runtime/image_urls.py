"""http(s) image URLs fetched safely (the server's `--allow-image-urls`, `LLM(allow_image_urls=True)`).

Policy, on every hop (the first URL and each redirect, followed here, at most MAX_REDIRECTS):
  - the host is resolved once and every address it resolves to is checked: loopback, private, link-local,
    shared (100.64/10), multicast, reserved and unspecified addresses are refused (IPv4, IPv6, and the IPv4
    inside IPv4-mapped, NAT64 and 6to4 IPv6 addresses), and so are cloud metadata addresses;
  - the connection goes to the address that was checked (the URL's host is replaced by it, the Host header and
    the TLS server name keep the name), so a name that resolves elsewhere a moment later (DNS rebinding) is
    never connected to;
  - environment proxies are not used (a proxy would resolve the name itself).
`allow_private` (the server's `--allow-private-image-urls`) lifts the address check but for metadata addresses,
which are refused always (they serve credentials, never images).

Every failure (a refused address, a name that does not resolve, a refused connection, an HTTP error status, a
timeout, a body over the size cap, bytes that are not an image) raises the same InputError text, so that a client
cannot map what answers where; the reason goes to the server log."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from moe_export.common.errors import InputError
from moe_export.runtime.images import MAX_IMAGE_BYTES, open_image
from PIL import Image

log = logging.getLogger("moe_export.image_urls")

MAX_REDIRECTS = 5
FETCH_TIMEOUT_S = 10.0  # all hops of one image URL
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# instance metadata services: AWS / GCP / Azure IMDS / Oracle / OpenStack (169.254.169.254), AWS IPv6 IMDS,
# AWS ECS task metadata, Alibaba Cloud, Azure WireServer (a public-looking address)
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200", "168.63.129.16"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
AddressCheck = Callable[[IPAddress], bool]


class FetchRefused(Exception):
    """Why one image URL was not fetched (logged on the server; the client gets `unfetchable`)."""


def unfetchable(where: str) -> InputError:
    """The one error a client gets for any image URL that was not fetched."""
    return InputError(f"{where}: the image URL could not be fetched (the server fetches PNG, JPEG, WebP or GIF "
                      "images from public http(s) addresses within its time and size limits)")


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, NAT64 64:ff9b::/96, 6to4), if any."""
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def public_address(ip: IPAddress) -> bool:
    """The default policy: a global unicast address that is no metadata address."""
    return address_allowed(ip, allow_private=False)


def private_allowed(ip: IPAddress) -> bool:
    """`--allow-private-image-urls`: any address but a metadata address."""
    return address_allowed(ip, allow_private=True)


def address_allowed(ip: IPAddress, allow_private: bool = False) -> bool:
    """Whether an image may be fetched from `ip`: never a metadata address; without `allow_private` only a
    global unicast address (whose embedded IPv4, if any, is one too)."""
    inner = embedded_ipv4(ip)
    if ip in METADATA_ADDRESSES or (inner is not None and inner in METADATA_ADDRESSES):
        return False
    if allow_private:
        return True
    return all(a.is_global and not a.is_multicast for a in ([ip] if inner is None else [ip, inner]))


async def system_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


class ImageURLFetcher:
    """Downloads image URLs under the policy above: at most `max_bytes` bytes each, each fetch (all its hops)
    within `timeout_s` seconds, from hosts all of whose addresses pass `allowed` (`public_address`, or
    `private_allowed`); `resolve` maps a host and port to its addresses."""

    def __init__(self, timeout_s: float, max_bytes: int, allowed: AddressCheck = public_address,
                 resolve: Resolver = system_resolve) -> None:
        self.timeout_s, self.max_bytes, self.allowed, self.resolve = timeout_s, max_bytes, allowed, resolve
        self._client: httpx.AsyncClient | None = None

    async def fetch(self, url: str, where: str) -> tuple[bytes, str]:
        """(bytes, media type) of the image at `url`; `unfetchable(where)` on any failure."""
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False, timeout=self.timeout_s, trust_env=False)
        try:
            async with asyncio.timeout(self.timeout_s):
                data = await self._download(httpx.URL(url))
            media = await asyncio.to_thread(image_media_type, data)
        except (FetchRefused, TimeoutError, httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
            log.info("image URL for %s not fetched: %s: %s", where, type(exc).__name__, exc)
            raise unfetchable(where) from None
        return data, media

    async def _download(self, url: httpx.URL) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            r = await self._client.send(await self._pinned_request(url), stream=True)
            try:
                if r.status_code in REDIRECT_STATUSES and "location" in r.headers:
                    url = url.join(r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise FetchRefused(f"HTTP {r.status_code}")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise FetchRefused(f"Content-Length {declared} over {self.max_bytes} bytes")
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise FetchRefused(f"body over {self.max_bytes} bytes")
                return bytes(data)
            finally:
                await r.aclose()
        raise FetchRefused(f"more than {MAX_REDIRECTS} redirects")

    async def _pinned_request(self, url: httpx.URL) -> httpx.Request:
        """A GET of `url` sent to a checked address of its host (Host header and TLS name kept)."""
        if url.scheme not in ("http", "https") or not url.host:
            raise FetchRefused(f"not an http(s) URL: {url.scheme}")
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = await self.resolve(url.host, port)
        refused = [a for a in addresses if not self.allowed(a)]
        if not addresses or refused:
            raise FetchRefused(f"{url.host} resolves to refused addresses {refused or 'none'}")
        headers = {"Host": url.netloc.decode("ascii")}
        extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
        return self._client.build_request("GET", url.copy_with(host=str(addresses[0])), headers=headers,
                                          extensions=extensions)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def image_media_type(data: bytes) -> str:
    """`image/png` etc. of PNG / JPEG / WebP / GIF bytes, decoded (so that a truncated or damaged image fails
    here, with the one error text, not later with the decoder's); ValueError for anything else."""
    try:
        image = open_image(data, "image", load=True)
    except InputError as exc:
        raise ValueError(str(exc)) from None
    return Image.MIME[image.format]


def fetch_image_url(url: str, where: str, allowed: AddressCheck = public_address, max_bytes: int = MAX_IMAGE_BYTES,
                    timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The blocking form of `ImageURLFetcher.fetch` (the in-process `LLM`'s image parts), run on its own event
    loop in a worker thread (so it may be called from a thread that runs a loop)."""

    async def once() -> bytes:
        fetcher = ImageURLFetcher(timeout_s, max_bytes, allowed)
        try:
            return (await fetcher.fetch(url, where))[0]
        finally:
            await fetcher.aclose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, once()).result()

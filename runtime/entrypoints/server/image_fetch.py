"""http(s) image parts fetched for a request before it reaches the runtime (`--allow-image-urls`): on the event
loop's own I/O (httpx's AsyncClient), never blocking it, each download within a total deadline and a size cap.
A fetched image replaces its URL by a data URL, so the runtime decodes it like any inline image."""

from __future__ import annotations

import asyncio
import base64

import httpx
from moe_export.common.errors import InputError


def url_parts(messages: list[dict]) -> list[tuple[str, dict]]:
    """(where, part) of every content part whose image is an http(s) URL."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            url = part.get("image_url") if isinstance(part, dict) else None
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                found.append((f"messages[{i}].content[{j}]", part))
    return found


class ImageFetcher:
    """Downloads image URLs: at most `max_bytes` bytes each, all of one download within `timeout_s` seconds."""

    def __init__(self, timeout_s: float, max_bytes: int) -> None:
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._client: httpx.AsyncClient | None = None

    async def fetch(self, url: str, where: str) -> tuple[bytes, str]:
        """(bytes, media type) of the image at `url`; InputError naming `where` on any failure."""
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=True, timeout=self.timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._download(url, where)
        except TimeoutError:
            raise InputError(f"{where}.image_url: fetching {url} took longer than {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise InputError(f"{where}.image_url: fetching {url} failed ({type(exc).__name__})") from None

    async def _download(self, url: str, where: str) -> tuple[bytes, str]:
        async with self._client.stream("GET", url) as r:
            if r.status_code != 200:
                raise InputError(f"{where}.image_url: fetching {url} answered HTTP {r.status_code}")
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise InputError(f"{where}.image_url: the image at {url} is larger than {self.max_bytes} bytes")
            data = bytearray()
            async for chunk in r.aiter_bytes():
                data += chunk
                if len(data) > self.max_bytes:
                    raise InputError(f"{where}.image_url: the image at {url} is larger than {self.max_bytes} bytes")
            media = r.headers.get("content-type", "").split(";")[0].strip()
            return bytes(data), media if media.startswith("image/") else "image/unknown"

    async def inline(self, messages: list[dict]) -> list[dict]:
        """`messages` with every http(s) image part's URL replaced by a data URL of its downloaded bytes (the
        downloads run at once); the messages given are not changed."""
        found = url_parts(messages)
        if not found:
            return messages
        fetched = await asyncio.gather(*(self.fetch(self._url(part), where) for where, part in found))
        inlined = {id(part): (data, media) for (where, part), (data, media) in zip(found, fetched)}
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list) and any(id(p) in inlined for p in content):
                m = {**m, "content": [self._data_part(p, *inlined[id(p)]) if id(p) in inlined else p for p in content]}
            out.append(m)
        return out

    @staticmethod
    def _url(part: dict) -> str:
        url = part["image_url"]
        return url["url"] if isinstance(url, dict) else url

    @staticmethod
    def _data_part(part: dict, data: bytes, media: str) -> dict:
        url = f"data:{media};base64,{base64.b64encode(data).decode()}"
        return {**part, "image_url": {**part["image_url"], "url": url} if isinstance(part["image_url"], dict) else url}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

"""http(s) image parts fetched for a request before it reaches the runtime (`--allow-image-urls`): on the event
loop's own I/O (httpx's AsyncClient), never blocking it, each download within a total deadline and a size cap,
under the URL policy of `runtime.image_urls` (public addresses only unless `--allow-private-image-urls`).
A fetched image replaces its URL by a data URL, so the runtime decodes it like any inline image."""

from __future__ import annotations

import asyncio
import base64

from moe_export.runtime.image_urls import ImageURLFetcher


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


class ImageFetcher(ImageURLFetcher):
    """Downloads the image URLs of a request's messages (`runtime.image_urls`: public addresses only unless
    `allow_private`, every redirect hop checked, one error text for every failure)."""

    async def inline(self, messages: list[dict]) -> list[dict]:
        """`messages` with every http(s) image part's URL replaced by a data URL of its downloaded bytes (the
        downloads run at once); the messages given are not changed."""
        found = url_parts(messages)
        if not found:
            return messages
        fetched = await asyncio.gather(*(self.fetch(self._url(part), f"{where}.image_url") for where, part in found))
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


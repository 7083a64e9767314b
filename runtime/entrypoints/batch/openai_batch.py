"""OpenAI Batch API / `vllm run-batch` JSONL: input lines, and their requests answered by the server's own
endpoints in process.

Input line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body": {...}}. Each body is POSTed to `moe-export serve`'s FastAPI app over an in-process
ASGI transport (no socket), on the batch's AsyncLLM: the same validation, conversions, structured output
and response objects as the server, one code path. Output: {"id", "custom_id", "response":
{"status_code": 200, "request_id", "body": <the endpoint's JSON>}, "error": null}; when the endpoint
refuses the request, "response" keeps the status code with body null and "error" is {"code": the OpenAI
error type, "message"}. Streaming bodies are refused (batch answers whole).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from moe_export.common.errors import InputError

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def parse_input_line(line: str, line_no: int) -> dict:
    """A JSONL line -> {"custom_id", "url", "body"}; InputError naming the line when malformed."""
    where = f"input line {line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(f"{where}: custom_id must be a non-empty string")
    if record.get("method", "POST") != "POST":
        raise InputError(f"{where} ({custom_id}): method must be POST, got {record.get('method')!r}")
    if record.get("url") not in URLS:
        raise InputError(f"{where} ({custom_id}): url must be one of {', '.join(URLS)}, got {record.get('url')!r}")
    if not isinstance(record.get("body"), dict):
        raise InputError(f"{where} ({custom_id}): body must be a JSON object")
    if record["body"].get("stream"):
        raise InputError(f"{where} ({custom_id}): stream=true is not supported in batch (answers are written whole)")
    return {"custom_id": custom_id, "url": record["url"], "body": record["body"]}


def custom_id_of(line: str) -> str | None:
    """The custom_id of a line that parses as JSON but is refused, to name it in its error line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    value = record.get("custom_id") if isinstance(record, dict) else None
    return value if isinstance(value, str) and value else None


class ServedEndpoints:
    """The server's app over an AsyncLLM, called in process; `post` returns (status code, request id, JSON)."""

    def __init__(self, allm, engine_dir: str | Path, concurrency: int) -> None:
        import httpx
        from moe_export.runtime.entrypoints.server.app import ServerSettings, create_app

        settings = ServerSettings(Path(engine_dir), max_queue=max(256, 2 * concurrency), model_name="moe-export",
                                  accept_any_model=True)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(allm, settings)),
                                        base_url="http://moe-export-batch", timeout=None)

    async def post(self, url: str, body: dict) -> tuple[int, str, dict]:
        request_id = f"req_{uuid.uuid4().hex}"
        r = await self.client.post(url, json=body, headers={"x-request-id": request_id})
        try:
            payload = r.json()
        except ValueError:
            payload = {"error": {"type": "server_error", "message": r.text[:2000]}}
        return r.status_code, request_id, payload

    async def aclose(self) -> None:
        await self.client.aclose()

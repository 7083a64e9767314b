"""OpenAI Batch API / `vllm run-batch` JSONL: input lines, and their requests answered by the server's own
endpoints in process.

Input line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body": {...}}. Each body is answered by the layer below `moe-export serve`'s routes (its
`Service` and route functions, called directly on the batch's AsyncLLM): the same validation, conversions,
structured output and response objects as the server, one code path. Output: {"id", "custom_id", "response":
{"status_code": 200, "request_id", "body": <the endpoint's JSON>}, "error": null}; when the endpoint
refuses the request, "response" keeps the status code with body null and "error" is {"code": the OpenAI
error type, "message"}. Streaming bodies are refused (batch answers whole).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path

from moe_export.common.errors import EngineDead, InputError

log = logging.getLogger("moe_export.batch")

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


CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*("(?:[^"\\]|\\.)+")')


def custom_id_of(line: str) -> str | None:
    """The custom_id of a refused line, to name it in its error line: from the JSON object, or, when the line is
    not JSON (cut, a stray comma), its readable `"custom_id": "..."` pair."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        found = CUSTOM_ID.search(line)
        if found is None:
            return None
        try:
            return json.loads(found[1]) or None
        except json.JSONDecodeError:
            return None
    value = record.get("custom_id") if isinstance(record, dict) else None
    return value if isinstance(value, str) and value else None


class ServedEndpoints:
    """The server's endpoints called in process on an AsyncLLM, below HTTP (the routes' own `Service`): `post`
    validates a body as the route does and returns (status code, request id, the answer's JSON or an error body)."""

    def __init__(self, allm, engine_dir: str | Path, concurrency: int) -> None:
        from moe_export.runtime.entrypoints.server.service import ServerSettings, Service

        settings = ServerSettings(Path(engine_dir), max_queue=max(256, 2 * concurrency), model_name="moe-export",
                                  accept_any_model=True)
        self.service = Service(allm, settings)

    async def post(self, url: str, body: dict) -> tuple[int, str, dict]:
        from moe_export.runtime.entrypoints.server.edge import validate
        from moe_export.runtime.entrypoints.server.errors import APIError, error_body

        request_id = f"req_{uuid.uuid4().hex}"
        try:
            model, call = endpoint(url)
            return 200, request_id, await call(self.service, validate(body, model))
        except APIError as exc:
            return exc.status, request_id, error_body(url, exc.status, exc.message, exc.param)
        except InputError as exc:
            return 400, request_id, error_body(url, 400, str(exc))
        except EngineDead as exc:
            return 503, request_id, error_body(url, 503, f"the engine core stopped ({exc})")
        except Exception as exc:  # one request's failure is its error line
            log.exception("internal error on batch request %s", request_id)
            return 500, request_id, error_body(url, 500, f"internal error ({type(exc).__name__}: {exc})")

    async def aclose(self) -> None:
        await self.service.aclose()


def endpoint(url: str):
    """(request model, service call taking (Service, request)) of a batch URL."""
    from moe_export.runtime.entrypoints.server import chat_completions, completions, protocol, responses
    from moe_export.runtime.entrypoints.server.store import key_scope

    async def create_response(svc, req):
        return await responses.create_response(svc, req, key_scope(None))

    return {"/v1/chat/completions": (protocol.ChatCompletionRequest, chat_completions.chat_completion),
            "/v1/completions": (protocol.CompletionRequest, completions.completion),
            "/v1/responses": (protocol.ResponsesRequest, create_response)}[url]

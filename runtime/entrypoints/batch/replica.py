"""One engine replica of `moe-export batch`: an LLM, its AsyncLLM and the item processor turning input items
into output records (used by the local run and by each Ray Data actor alike)."""

from __future__ import annotations

import asyncio
import gc
import uuid

from moe_export.common.errors import InputError
from moe_export.runtime.client.protocol import EngineClient
from moe_export.runtime.entrypoints.batch.doc_tasks import (
    DocJob,
    DocRunner,
    OverLongDocument,
    RefusedImages,
)
from moe_export.runtime.entrypoints.batch.openai_batch import ServedEndpoints


def ok_record(item: dict, body: dict, request_id: str | None = None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item["custom_id"],
              "response": {"status_code": 200, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
              "error": None}
    if item.get("content_hash"):
        record["content_hash"] = item["content_hash"]
    if item.get("warnings"):
        record["warnings"] = item["warnings"]  # the extractor's remarks on a damaged but readable document
    return record


def error_record(custom_id: str, code: str, message: str, content_hash: str | None = None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
              "error": {"code": code, "message": message}}
    if content_hash:
        record["content_hash"] = content_hash
    return record


class ItemProcessor:
    """Turns items into output records on one AsyncLLM (shared by the local and the Ray runner): batch API
    lines through the server's endpoints in process, documents through a DocRunner."""

    def __init__(self, llm: EngineClient, engine_dir: str, max_seq_len: int, doc_job: DocJob | None, concurrency: int) -> None:
        self.concurrency = concurrency
        self.semaphore = asyncio.Semaphore(concurrency)
        self.docs = DocRunner(llm, doc_job, max_seq_len, self.semaphore) if doc_job is not None else None
        self.endpoints = ServedEndpoints(llm, engine_dir, concurrency) if doc_job is None else None

    async def _endpoint(self, item: dict) -> dict:
        async with self.semaphore:
            status, request_id, payload = await self.endpoints.post(item["url"], item["body"])
        if status == 200:
            return ok_record(item, payload, request_id)
        error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
        record = error_record(item["custom_id"], str(error.get("type", f"http_{status}")),
                              str(error.get("message", payload)))
        record["response"] = {"status_code": status, "request_id": request_id, "body": None}
        return record

    async def process(self, item: dict) -> dict:
        try:
            if item["kind"] == "doc":
                return ok_record(item, await self.docs.run(item["custom_id"], item["text"], item.get("images", ())))
            return await self._endpoint(item)
        except OverLongDocument as exc:
            return error_record(item["custom_id"], "over_long", str(exc), item.get("content_hash"))
        except RefusedImages as exc:
            return error_record(item["custom_id"], exc.code, str(exc), item.get("content_hash"))
        except InputError as exc:
            return error_record(item["custom_id"], "invalid_request", str(exc), item.get("content_hash"))
        except Exception as exc:  # one item's failure is its error line, never the run's end
            return error_record(item["custom_id"], "generation_failed", f"{type(exc).__name__}: {exc}",
                                item.get("content_hash"))

    async def aclose(self) -> None:
        if self.endpoints is not None:
            await self.endpoints.aclose()


def start_llm(engine_dir: str, default_effort: str | None, concurrency: int, doc_job: DocJob | None):
    """(LLM, AsyncLLM over it, ItemProcessor) on `engine_dir`; call inside the event loop that will use them.
    concurrency 0 means twice the engine's sequence slots (the scheduler always has a queue to fill from)."""
    from moe_export.runtime.client.async_llm import AsyncLLM
    from moe_export.runtime.client.llm import LLM

    # each line is one request, never continued: no warm turns (`LLM.warm_turns`)
    llm = LLM(engine_dir, warm_turns=False, **({} if default_effort is None else {"default_effort": default_effort}))
    try:
        if doc_job is not None and doc_job.images and llm.engine.vision is None:
            raise InputError(f"--images: the runner of {engine_dir} has no vision tower, so it takes no images")
        allm = AsyncLLM(llm)
        processor = ItemProcessor(allm, engine_dir, llm.engine.max_seq_len, doc_job,
                                  concurrency or 2 * llm.engine.num_slots)
    except BaseException:
        llm.shutdown()
        raise
    # What exists now (modules, the engine, the tokenizer's tables) lives until the job ends: frozen out of the
    # cyclic collector's scans, the collections at interpreter exit no longer walk it (default batch benchmark:
    # from the job's end to the process's exit 0.9-1.0 s before, 0.2-0.3 s frozen)
    gc.freeze()
    return llm, allm, processor

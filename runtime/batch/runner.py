"""`moe-export batch`: items in (OpenAI batch JSONL, or a folder of documents), one output line per item.

Every request goes through one AsyncLLM (continuous batching): `concurrency` items are in flight at once
and the scheduler packs their prefill and decode steps together. Items already in the output (by
custom_id, or custom_id + content hash for documents) are skipped, so a killed run resumes where it
stopped; refused items become error lines and the run goes on. With `ray_address` the same items run on
Ray Data instead (runtime/batch/ray_runner.py), one engine replica per actor.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe_export.export.errors import InputError
from moe_export.runtime.batch.doc_tasks import DocJob, DocRunner, OverLongDocument
from moe_export.runtime.batch.documents import read_documents
from moe_export.runtime.batch.openai_batch import ServedEndpoints, custom_id_of, parse_input_line
from moe_export.runtime.batch.output import ResultLog


@dataclass
class BatchSummary:
    """Counts of this run (skipped = already in the output from an earlier run)."""

    ok: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, record: dict) -> None:
        if record["error"] is None:
            self.ok += 1
            usage = record["response"]["body"].get("usage", {})
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
            self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        else:
            self.failed += 1
            self.errors[record["error"]["code"]] = self.errors.get(record["error"]["code"], 0) + 1


def ok_record(item: dict, body: dict, request_id: str | None = None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item["custom_id"],
              "response": {"status_code": 200, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
              "error": None}
    if item.get("content_hash"):
        record["content_hash"] = item["content_hash"]
    return record


def error_record(custom_id: str, code: str, message: str, content_hash: str | None = None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
              "error": {"code": code, "message": message}}
    if content_hash:
        record["content_hash"] = content_hash
    return record


def collect_items(input_path: Path, log: ResultLog, max_file_bytes: int) -> tuple[list[dict], list[dict], int]:
    """(pending items, error records of refused inputs, count already done). Items are plain dicts:
    {"kind": "openai", custom_id, url, body} or {"kind": "doc", custom_id, content_hash, text}."""
    pending, refused, skipped = [], [], 0
    if input_path.is_dir():
        for doc in read_documents(input_path, max_file_bytes):
            if doc.key in log.done:
                skipped += 1
            elif doc.error_code:
                refused.append(error_record(doc.custom_id, doc.error_code, doc.error_message, doc.content_hash))
            else:
                pending.append({"kind": "doc", "custom_id": doc.custom_id, "content_hash": doc.content_hash, "text": doc.text})
        return pending, refused, skipped
    if not input_path.is_file():
        raise InputError(f"--input {input_path}: no such file or folder")
    seen: set[str] = set()
    with open(input_path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.read().splitlines()
        except UnicodeDecodeError as exc:
            raise InputError(f"--input {input_path}: not UTF-8 JSONL ({exc.reason} at byte {exc.start})") from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = parse_input_line(line, line_no)
        except InputError as exc:
            custom_id = custom_id_of(line) or f"line-{line_no}"
            if custom_id not in log.done:
                refused.append(error_record(custom_id, "bad_record", str(exc)))
            else:
                skipped += 1
            continue
        if item["custom_id"] in log.done:
            skipped += 1
        elif item["custom_id"] in seen:
            refused.append(error_record(item["custom_id"], "duplicate_custom_id",
                                        f"input line {line_no}: custom_id {item['custom_id']} already used above"))
        else:
            seen.add(item["custom_id"])
            pending.append({"kind": "openai", **item})
    return pending, refused, skipped


class ItemProcessor:
    """Turns items into output records on one AsyncLLM (shared by the local and the Ray runner): batch API
    lines through the server's endpoints in process, documents through a DocRunner."""

    def __init__(self, llm, engine_dir: str, default_effort: str | None, max_seq_len: int, doc_job: DocJob | None,
                 concurrency: int) -> None:
        self.concurrency = concurrency
        self.semaphore = asyncio.Semaphore(concurrency)
        self.docs = DocRunner(llm, doc_job, max_seq_len, self.semaphore) if doc_job is not None else None
        self.endpoints = ServedEndpoints(llm, engine_dir, default_effort, concurrency) if doc_job is None else None

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
                return ok_record(item, await self.docs.run(item["custom_id"], item["text"]))
            return await self._endpoint(item)
        except OverLongDocument as exc:
            return error_record(item["custom_id"], "over_long", str(exc), item.get("content_hash"))
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
    from moe_export.runtime.llm import LLM, AsyncLLM

    llm = LLM(engine_dir, **({} if default_effort is None else {"default_effort": default_effort}))
    try:
        allm = AsyncLLM(llm)
        processor = ItemProcessor(allm, engine_dir, default_effort, llm.engine.max_seq_len, doc_job,
                                  concurrency or 2 * llm.engine.num_slots)
    except BaseException:
        llm.shutdown()
        raise
    return llm, allm, processor


async def run_local(engine_dir: str, pending: list[dict], doc_job: DocJob | None, concurrency: int,
                    default_effort: str | None, emit: Callable[[dict], None]) -> None:
    """Process `pending` on one in-process engine; `emit(record)` is called as each item finishes."""
    llm, allm, processor = start_llm(engine_dir, default_effort, concurrency, doc_job)
    try:
        queue: asyncio.Queue = asyncio.Queue()
        for item in pending:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty():
                emit(await processor.process(queue.get_nowait()))

        await asyncio.gather(*(worker() for _ in range(max(1, min(processor.concurrency, len(pending))))))
        await processor.aclose()
    finally:
        allm.shutdown()
        llm.shutdown()


def run_batch(engine_dir: str, input_path: str, output: str, *, concurrency: int | None = None,
              doc_job: DocJob | None = None, ray_address: str | None = None, ray_actors: int = 2,
              default_effort: str | None = None, max_file_bytes: int = 64 << 20, console=None) -> BatchSummary:
    """The whole `moe-export batch` job; returns this run's summary (the caller maps failures to the exit code)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    src = Path(input_path)
    if not (Path(engine_dir) / "config.json").is_file():
        raise InputError(f"{engine_dir}: not an engine directory (no config.json); build one with moe-export build")
    if src.is_dir() and doc_job is None:
        raise InputError(f"--input {input_path} is a folder of documents: give --task or --prompt-file")
    if not src.is_dir() and doc_job is not None:
        raise InputError("--task / --prompt-file apply to a folder of documents, not to a batch JSONL file")
    if concurrency is not None and concurrency < 1:
        raise InputError(f"--concurrency must be >= 1, got {concurrency}")
    log = ResultLog(output)
    summary = BatchSummary()
    start = time.perf_counter()
    try:
        pending, refused, summary.skipped = collect_items(src, log, max_file_bytes)
        for record in refused:
            log.append(record)
            summary.add(record)
        with Progress(TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[items_s]:.2f} items/s {task.fields[tok_s]:.1f} tok/s"),
                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("items", total=len(pending), items_s=0.0, tok_s=0.0)
            t0 = time.perf_counter()
            done = {"n": 0}

            def emit(record: dict) -> None:
                log.append(record)
                summary.add(record)
                done["n"] += 1
                elapsed = max(time.perf_counter() - t0, 1e-9)
                progress.update(task, advance=1, items_s=done["n"] / elapsed, tok_s=summary.completion_tokens / elapsed)

            if pending and ray_address is not None:
                from moe_export.runtime.batch.ray_runner import run_on_ray

                run_on_ray(engine_dir, pending, doc_job, concurrency or 0, default_effort, ray_address, ray_actors, emit)
            elif pending:
                asyncio.run(run_local(engine_dir, pending, doc_job, concurrency or 0, default_effort, emit))
    finally:
        log.close()
    summary.seconds = time.perf_counter() - start
    return summary


def render_summary(summary: BatchSummary, console) -> None:
    from rich.table import Table

    table = Table(title="batch summary")
    table.add_column("")
    table.add_column("value", justify="right")
    rate = (summary.ok + summary.failed) / summary.seconds if summary.seconds else 0.0
    for name, value in (("succeeded", summary.ok), ("failed", summary.failed), ("skipped (already done)", summary.skipped),
                        ("prompt tokens", summary.prompt_tokens), ("completion tokens", summary.completion_tokens),
                        ("seconds", f"{summary.seconds:.1f}"), ("items/s", f"{rate:.2f}"),
                        ("completion tok/s", f"{summary.completion_tokens / summary.seconds if summary.seconds else 0:.1f}")):
        table.add_row(name, str(value))
    for code, n in sorted(summary.errors.items()):
        table.add_row(f"error: {code}", str(n))
    console.print(table)

"""`moe-export batch`: items in (OpenAI batch JSONL, or a folder of documents), one output line per item.

Every request goes through one AsyncLLM (continuous batching): `concurrency` items are in flight at once
and the scheduler packs their prefill and decode steps together. Items already in the output (by
custom_id, or custom_id + content hash for documents) are skipped, so a killed run resumes where it
stopped; a document whose content changed since its line was written is done again and its old line removed
(one line per document); refused items become error lines and the run goes on. Every option is checked
before the engine loads and before the output is touched. With `ray_address` the same items run on
Ray Data instead (`ray_runner`), one engine replica per actor; both run items through `replica`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.batch.doc_tasks import DocJob, chunk_budget
from moe_export.runtime.entrypoints.batch.documents import files_of_other_types, image_files, read_documents
from moe_export.runtime.entrypoints.batch.openai_batch import (
    custom_id_of,
    parse_input_line,
)
from moe_export.runtime.entrypoints.batch.output import ResultLog
from moe_export.runtime.entrypoints.batch.replica import error_record, start_llm


@dataclass
class BatchSummary:
    """Counts of this run (skipped = already in the output from an earlier run; failed_earlier = those of them
    that are error lines: the job still has failed items, so the exit code says so)."""

    ok: int = 0
    failed: int = 0
    skipped: int = 0
    failed_earlier: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    images: int = 0  # images sent with the documents that succeeded (--images)
    images_ignored: int = 0  # image files left out of a document folder run without --images
    other_files: int = 0  # files of a type no run reads (.docx, .csv, ...) left out of a document folder
    replaced: int = 0  # documents changed since their line was written: the old line removed, done again
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, record: dict) -> None:
        if record["error"] is None:
            self.ok += 1
            self.images += record["response"]["body"].get("images", 0)
            usage = record["response"]["body"].get("usage", {})
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
            self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        else:
            self.failed += 1
            self.errors[record["error"]["code"]] = self.errors.get(record["error"]["code"], 0) + 1


def collect_items(input_path: Path, log: ResultLog, max_file_bytes: int,
                  images: bool = False) -> tuple[list[dict], list[dict], list[str], int]:
    """(pending items, error records of refused inputs, keys already done, documents whose old lines were
    removed because their content changed). Items are plain dicts: {"kind": "openai", custom_id, url, body} or
    {"kind": "doc", custom_id, content_hash, text, warnings?, images?: [{url, source, offset}]}."""
    pending, refused, skipped = [], [], []
    if input_path.is_dir():
        docs = list(read_documents(input_path, max_file_bytes, images))
        stale = log.stale({doc.custom_id: doc.key for doc in docs})
        log.drop(stale)
        for doc in docs:
            if doc.key in log.done:
                skipped.append(doc.key)
            elif doc.error_code:
                refused.append(error_record(doc.custom_id, doc.error_code, doc.error_message, doc.content_hash))
            else:
                item = {"kind": "doc", "custom_id": doc.custom_id, "content_hash": doc.content_hash, "text": doc.text}
                if doc.warnings:
                    item["warnings"] = list(doc.warnings)
                if doc.images:
                    item["images"] = [{"url": im.url, "source": im.source, "offset": im.offset} for im in doc.images]
                pending.append(item)
        return pending, refused, skipped, len({key.rpartition("@")[0] for key in stale})
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
                skipped.append(custom_id)
            continue
        if item["custom_id"] in log.done:
            skipped.append(item["custom_id"])
        elif item["custom_id"] in seen:
            refused.append(error_record(item["custom_id"], "duplicate_custom_id",
                                        f"input line {line_no}: custom_id {item['custom_id']} already used above"))
        else:
            seen.add(item["custom_id"])
            pending.append({"kind": "openai", **item})
    return pending, refused, skipped, 0


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


def require_tower(engine_dir: str) -> None:
    """InputError unless the engine has an image tower (`--images` needs one); the runner is checked again
    when it is loaded (`replica.start_llm`)."""
    from moe_export.graphs.vision_export import VISION_GRAPH

    if not (Path(engine_dir) / VISION_GRAPH).is_file():
        raise InputError(f"--images: {engine_dir} has no vision tower ({VISION_GRAPH}); image input needs a K3 engine "
                         "built with its vision_config")


def run_batch(engine_dir: str, input_path: str, output: str, *, concurrency: int | None = None,
              doc_job: DocJob | None = None, ray_address: str | None = None, ray_actors: int = 2,
              default_effort: str | None = None, max_file_bytes: int = 64 << 20, console=None) -> BatchSummary:
    """The whole `moe-export batch` job; returns this run's summary (the caller maps failures to the exit code)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    src = Path(input_path)
    EngineConfig.read(engine_dir)  # an engine directory whose config.json is valid, before any input is read
    if src.is_dir() and doc_job is None:
        raise InputError(f"--input {input_path} is a folder of documents: give --task or --prompt-file")
    if not src.is_dir() and doc_job is not None:
        raise InputError("--task / --prompt-file apply to a folder of documents, not to a batch JSONL file")
    if concurrency is not None and concurrency < 1:
        raise InputError(f"--concurrency must be >= 1, got {concurrency}")
    if max_file_bytes < 1:
        raise InputError(f"--max-file-bytes must be >= 1, got {max_file_bytes}")
    if ray_address is not None and ray_actors < 1:
        raise InputError(f"--ray-actors must be >= 1, got {ray_actors}")
    images = doc_job is not None and doc_job.images
    if images:
        require_tower(engine_dir)
    if doc_job is not None:  # the chunk budget the options leave in the engine's context (tokenizer only)
        from moe_export.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(engine_dir)
        chunk_budget(doc_job, tokenizer, tokenizer.family, EngineConfig.read(engine_dir).limits.max_seq_len)
    log = ResultLog(output)
    summary = BatchSummary()
    if src.is_dir():
        summary.other_files = len(files_of_other_types(src))
        summary.images_ignored = 0 if images else len(image_files(src))
    start = time.perf_counter()
    try:
        pending, refused, skipped, summary.replaced = collect_items(src, log, max_file_bytes, images)
        summary.skipped = len(skipped)
        summary.failed_earlier = len(set(skipped) & log.failed)
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
                from moe_export.runtime.entrypoints.batch.ray_runner import run_on_ray

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
                        ("of them failed (earlier runs)", summary.failed_earlier),
                        ("prompt tokens", summary.prompt_tokens), ("completion tokens", summary.completion_tokens),
                        ("changed since their line: redone", summary.replaced),
                        ("images sent", summary.images), ("image files ignored (no --images)", summary.images_ignored),
                        ("files of other types ignored", summary.other_files),
                        ("seconds", f"{summary.seconds:.1f}"), ("items/s", f"{rate:.2f}"),
                        ("completion tok/s", f"{summary.completion_tokens / summary.seconds if summary.seconds else 0:.1f}")):
        table.add_row(name, str(value))
    for code, n in sorted(summary.errors.items()):
        table.add_row(f"error: {code}", str(n))
    console.print(table)

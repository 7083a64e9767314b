"""`moe-export batch --ray auto|ADDRESS`: the same items on Ray Data, for collections larger than one
machine's throughput.

read (the driver's pending items) -> `ray.data.from_items` -> `map_batches(ReplicaWorker)` on an actor pool
(one engine replica per actor, each batch of items run concurrently through that replica's AsyncLLM, so
its scheduler batches them continuously) -> rows streamed back to the driver, which appends each record to
the output file (the same whole-line, fsynced, resumable writer as the local run). `auto` connects to the
Ray cluster of this machine, or starts a local one; ADDRESS connects to that cluster's head.
Needs the optional `ray` extra (`pip install 'moe-export[ray]'`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from moe_export.common.errors import InputError


class ReplicaWorker:
    """A Ray Data actor: one engine replica, and its own event loop driving the replica's AsyncLLM."""

    def __init__(self, engine_dir: str, doc_job, concurrency: int, default_effort: str | None) -> None:
        from moe_export.runtime.entrypoints.batch.replica import start_llm

        self.loop = asyncio.new_event_loop()

        async def start():
            return start_llm(engine_dir, default_effort, concurrency, doc_job)

        self.llm, self.allm, self.processor = self.loop.run_until_complete(start())

    def __call__(self, batch: dict) -> dict:
        """batch {"item": [JSON item]} -> {"record": [JSON output record]} (same order)."""
        items = [json.loads(text) for text in batch["item"]]

        async def run():
            return await asyncio.gather(*(self.processor.process(item) for item in items))

        return {"record": [json.dumps(record) for record in self.loop.run_until_complete(run())]}


def run_on_ray(engine_dir: str, pending: list[dict], doc_job, concurrency: int, default_effort: str | None,
               address: str, actors: int, emit: Callable[[dict], None]) -> None:
    """Run `pending` on Ray Data with `actors` engine replicas; `emit(record)` for each finished item."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise InputError("--ray needs Ray Data: pip install 'moe-export[ray]' (ray[data])") from None
    if actors < 1:
        raise InputError(f"--ray-actors must be >= 1, got {actors}")
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=None if address == "auto" else address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise InputError(f"--ray {address}: cannot connect to a Ray cluster ({exc})") from None
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        per_batch = max(1, concurrency or 16)
        ds = ray.data.from_items([{"item": json.dumps(item)} for item in pending])
        results = ds.map_batches(
            ReplicaWorker,
            fn_constructor_kwargs={"engine_dir": str(engine_dir), "doc_job": doc_job, "concurrency": concurrency,
                                   "default_effort": default_effort},
            batch_size=per_batch, concurrency=actors, num_cpus=1,
        )
        for row in results.iter_rows():
            emit(json.loads(row["record"]))
    finally:
        if started_here:
            ray.shutdown()

"""The engine core on rank 0: one `step()` is schedule -> execute -> update, as vLLM v1's `EngineCore.step`.

`Scheduler.schedule()` plans a `ScheduledStep` (rows, the plan every rank runs, packed sampling rows),
`StepExecutor` runs it (broadcast under mpiexec; with overlap in its worker thread), `Scheduler.update()` applies
the sampled tokens and returns each request's `SequenceUpdate`. The core is the only caller of the executor: it
runs the vision tower for waiting image requests, counts failed steps in a row (`max_failed_steps` -> EngineDead),
plans the next step while one runs (overlap, see `core.scheduler`), and, as a dp-layout group's core (`lockstep`),
runs an idle step whenever the plan has no rows, so every rank runs one engine step per world step
(`core.wide_ep`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from moe_export.common.errors import EngineDead
from moe_export.runtime.core.contracts import Request, SequenceUpdate, VisionPlan
from moe_export.runtime.core.execution import WORLD_BROKEN, PreviousStepFailed, StepExecutor
from moe_export.runtime.core.scheduler import ScheduledStep, Scheduler, describe
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.core.state_offload import ReadPlan
from moe_export.runtime.engine.runner import ModelRunner, StepRefused

MAX_FAILED_STEPS = 3  # runner failures in a row after which the engine core is dead


@dataclass
class Flight:
    """A started step: what was scheduled and its executor future (None: nothing to run)."""

    step: ScheduledStep
    future: Future | None = None


class EngineCore:
    """Scheduler + executor over `engine` (rank 0). scheduler_kwargs: `Scheduler`'s (overlap included).
    max_failed_steps: runner failures in a row that make `step()` raise EngineDead. lockstep: a dp-layout group's
    core: every `step()` runs exactly one engine step, an idle one when nothing is runnable (no overlap).
    executor: run the steps on another core's `StepExecutor` (its worker thread, its broadcast to the follower
    ranks; `LLM.warm_up`, whose scheduler has no offload store) instead of one of its own."""

    def __init__(self, engine: ModelRunner, *, max_failed_steps: int = MAX_FAILED_STEPS, lockstep: bool = False,
                 executor: StepExecutor | None = None, **scheduler_kwargs) -> None:
        if lockstep:
            scheduler_kwargs["overlap"] = False
        self.engine = engine
        self.scheduler = Scheduler(engine, **scheduler_kwargs)
        self.overlap = self.scheduler.overlap
        offload = self.scheduler.resources.offload
        self.executor = executor or StepExecutor(engine, overlap=self.overlap, offload=offload)
        if offload is not None:  # (multi-rank: every rank checks its own copy before a load)
            offload.agree = self.executor.in_order
        self.lockstep = lockstep
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # runner failures in a row
        self.planned_ahead = 0  # steps planned while the previous one ran (overlap)
        self._flight: Flight | None = None

    # ---- requests (the scheduler's) --------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def add_warm(self, request: Request) -> None:
        """A warm turn: prefill-only, at low priority (`Scheduler.add_warm`)."""
        self.scheduler.add_warm(request)

    def check(self, request: Request) -> Sequence:
        return self.scheduler.check(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._flight is not None

    @property
    def load(self) -> int:
        return self.scheduler.load

    def stats(self) -> dict:
        return self.scheduler.stats()

    # ---- one iteration ---------------------------------------------------------------------------

    def step(self) -> list[SequenceUpdate]:
        """Run one engine step (if anything is runnable; as a lockstep core an idle one otherwise); returns the
        updates it produced. With overlap the step after it is already running when this returns (planned while
        this one ran where nothing in it needed this step's tokens, else planned from them), so processing the
        updates overlaps it; a request aborted meanwhile has its token of that step dropped. EngineDead after
        `max_failed_steps` failed steps in a row."""
        flight = self._flight if self._flight is not None else self._start()
        self._flight = None
        if not self.executor.failed and self.scheduler.can_plan_ahead(flight.step):
            ahead = self._start()
            if ahead.step.rows:
                self._flight = ahead
                self.planned_ahead += 1
            else:  # nothing runnable before the flight's tokens are in: plan again after them
                self.scheduler.requeue_ended(ahead.step.updates)
        updates = self._finish(flight)
        if self.overlap and self._flight is None and self.has_work:
            self._flight = self._start()
        if not self.has_work:  # idle: the offload store's queued reads now (`core.state_offload`), not at a next step
            self.scheduler.resources.offload_idle(self._read_rows)
        return updates

    def _start(self) -> Flight:
        """Encode waiting images, schedule one step and start it (in the worker thread with overlap). A
        lockstep core runs an idle step when the plan has no rows."""
        self._encode_images()
        step = self.scheduler.schedule()
        if step.rows:
            return Flight(step, self.executor.submit(step.plan, step.sampling, step.futures))
        if self.lockstep:
            try:
                self.executor.execute(step.plan)
            except StepRefused:  # every rank refused this world step by agreement: this group had nothing in it
                pass
        return Flight(step)

    def _finish(self, flight: Flight) -> list[SequenceUpdate]:
        """Wait for a started step and apply its tokens; a failed step fails its sequences instead."""
        if flight.future is None:
            return flight.step.updates
        try:
            out = flight.future.result()
        except Exception as exc:
            updates = self.scheduler.step_failed(flight.step, exc)
            self._count_failure(exc)
            return updates
        self.failed_steps = 0
        return self.scheduler.update(flight.step, out.sampled, out.reads)

    def _encode_images(self) -> None:
        """Run the tower for waiting requests whose images have no embeddings yet (cache hits first, the rest in
        one packed call). A failing call fails those requests, like a failing step."""
        pending = self.scheduler.awaiting_images()
        if not pending:
            return
        vision = self.engine.vision
        images = [im for s in pending for im in s.request.images]
        found, missing = vision.lookup(images)
        if missing:
            try:
                out = self.executor.encode(VisionPlan([(im.pixel_values, list(im.plan.grid)) for im in missing]))
            except Exception as exc:
                self._count_failure(exc)
                self.scheduler.images_failed(pending, exc)
                return
            for im, emb in zip(missing, out):
                found[im.digest] = emb
                vision.store(im.digest, emb)
        self.scheduler.images_encoded(pending, found)

    def _count_failure(self, exc: BaseException) -> None:
        """One more runner failure in a row (a step skipped for its predecessor's failure is not one); an
        EngineDead (under mpiexec: a step failed on some rank, the world ends) kills the core at once."""
        if isinstance(exc, EngineDead):
            raise exc
        if not isinstance(exc, PreviousStepFailed):
            self.failed_steps += 1
        if self.failed_steps >= self.max_failed_steps:
            raise EngineDead(f"{self.failed_steps} engine steps in a row failed, the last with {describe(exc)}") from exc

    def shutdown(self) -> None:
        """Let a step still running finish (overlap), then tell follower ranks to leave `follow()` (rank 0,
        multi-rank only)."""
        self._flight = None
        if not WORLD_BROKEN.is_set():  # (every rank reads what is still queued, after a step still running)
            self.scheduler.resources.offload_idle(self._read_rows)
        self.executor.shutdown()
        self.scheduler.resources.close_offload()

    def _read_rows(self, plan: ReadPlan) -> list[dict[str, np.ndarray]]:
        """An offload read on every rank, in order with the steps."""
        return self.executor.in_order(plan).reads

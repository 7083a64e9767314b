"""Running step plans: `run_plan` on any rank, `StepExecutor` on rank 0 (broadcast, then run; with overlap in one
worker thread, in order), `follow` on the other ranks of a group, `stop_the_world` when a rank fails under mpiexec
(a failed step there leaves the other ranks inside a collective: every rank is aborted, none hangs)."""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import numpy as np
from moe_export.runtime.core.contracts import RunnerOutput, StepPlan, VisionPlan
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.runner import ModelRunner, VisionRunner
from moe_export.runtime.engine.sampler import SamplingBatch


def run_plan(engine: ModelRunner, plan: StepPlan | VisionPlan, sampling: SamplingBatch | None = None) -> RunnerOutput:
    """Apply a plan on this rank: a tower call -> the images' embeddings; a step -> reset and restore slots, one
    runner step choosing the tokens of `sampling` (rank 0; None on followers), then the checkpoint saves. A step
    without chunks is an idle step of a dp-layout group (see `runtime.core.wide_ep`)."""
    if isinstance(plan, VisionPlan):
        return RunnerOutput(image_embeds=cast(VisionRunner, engine).encode_images(plan.images))
    for slot in plan.resets:
        engine.reset_slot(slot)
    for checkpoint, slot in plan.restores:
        engine.restore_state(slot, checkpoint)
    width = cast(VisionRunner, engine).image_width if engine.vision is not None else None
    batch = StepBatch.from_sequences(plan.chunks, width) if plan.chunks else None
    out = RunnerOutput(sampled=engine.sample(batch, sampling))
    for slot, checkpoint in plan.saves:
        engine.save_state(slot, checkpoint)
    return out


class PreviousStepFailed(RuntimeError):
    """A planned-ahead step whose input tokens were to come from a step that failed: it does not run."""


class StepExecutor:
    """Rank 0's side of running plans over `engine`: broadcast each plan (multi-rank) and run it here. overlap:
    every plan runs in one worker thread, in order (`submit` returns at once); else `submit` runs it now.
    steps: step plans started so far (tower calls excluded); failed: the latest step run failed."""

    def __init__(self, engine: ModelRunner, *, overlap: bool) -> None:
        self.engine = engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moe-export-step") if overlap else None
        self.last_ids: np.ndarray | None = None  # the latest sampled ids (fill future tokens)
        self.steps = 0
        self.failed = False

    def execute(self, plan: StepPlan | VisionPlan, sampling: SamplingBatch | None = None) -> RunnerOutput:
        """Broadcast `plan` (multi-rank) and run it on this rank. A failure under mpiexec stops every rank."""
        step = isinstance(plan, StepPlan)
        if step:
            self.steps += 1
        comm = self.engine.comm
        try:
            if comm is not None:
                comm.broadcast(plan)
            out = run_plan(self.engine, plan, sampling)
        except BaseException as exc:
            self.failed = self.failed or step
            stop_the_world(self.engine, exc)
            raise
        self.failed = self.failed and not step
        if out.sampled is not None:
            self.last_ids = out.sampled.ids
        return out

    def _run_ahead(self, futures: list[SequenceChunk], plan: StepPlan, sampling: SamplingBatch | None) -> RunnerOutput:
        """The worker: fill in the future tokens of a planned-ahead step from the previous step's ids (before the
        broadcast: the plan shares the chunks' token lists), then run it."""
        if self.failed:
            self.steps += 1
            raise PreviousStepFailed("the step whose tokens this step continues failed")
        for chunk in futures:
            chunk.tokens[-1] = int(self.last_ids[-1 - chunk.tokens[-1]])
        return self.execute(plan, sampling)

    def submit(self, plan: StepPlan, sampling: SamplingBatch | None, futures: list[SequenceChunk]) -> Future:
        """Start a step: in the worker (overlap; `futures`: its chunks whose last token is a future token), else
        run now. The future holds its output or its exception."""
        if self.pool is not None:
            if futures:
                return self.pool.submit(self._run_ahead, futures, plan, sampling)
            return self.pool.submit(self.execute, plan, sampling)
        done: Future = Future()
        try:
            done.set_result(self.execute(plan, sampling))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def encode(self, plan: VisionPlan) -> list[np.ndarray]:
        """A tower call, in order with the steps (in the worker with overlap)."""
        out = self.pool.submit(self.execute, plan).result() if self.pool is not None else self.execute(plan)
        return out.image_embeds

    def shutdown(self) -> None:
        """Let a step still running finish, then tell follower ranks to leave `follow()` (multi-rank)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.engine.comm is not None:
            self.engine.comm.broadcast(None)


def follow(engine: ModelRunner) -> int:
    """Non-root ranks: execute rank 0's plans until it shuts down; returns the number of steps run."""
    steps = 0
    while True:
        try:
            plan = engine.comm.broadcast(None)
            if plan is None:
                return steps
            run_plan(engine, plan)
        except BaseException as exc:
            stop_the_world(engine, exc)
            raise
        steps += 1


def stop_the_world(engine: ModelRunner, exc: BaseException) -> None:
    """Multi-rank: report which rank failed and why, then abort every rank (MPI Abort), never hang."""
    comm = engine.comm
    if comm is None:
        return
    rank = comm.world.Get_rank()
    print(f"moe-export: rank {rank} of {comm.world.Get_size()} failed, stopping all ranks: "
          f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    time.sleep(1.0)  # let the launcher forward that line before the abort tears its I/O down
    comm.world.Abort(1)

"""Running step plans: `run_plan` on any rank, `StepExecutor` on rank 0 (broadcast, then run; with overlap in one
worker thread, in order), `follow` on the other ranks of a group, and the end of the world when a step's collective
part fails under mpiexec (`stop_the_world`, `FaultWatch`).

Failure classes under mpiexec. Choosing tokens happens on the rank holding the logits after everything collective
in the step (`runner.choose_tokens`), so a request's own failures (its sampling row, sampler, grammar, output)
never reach this module. A step every rank refused by agreement (`StepRefused`) fails the step's requests and the
ranks go on. Any other failure of a step, on any rank, may have left the other ranks inside a collective: the
failed rank reports itself (stderr) and sends a fault notice to world rank 0, whose `FaultWatch` marks the engine
core dead (the API answers 503, /health too), waits FAULT_LINGER_S for those answers to go out and aborts every
rank (exit status 1). A failed rank other than 0 aborts the world itself after FAULT_GRACE_S, should rank 0 not
(no rank is ever left waiting)."""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import numpy as np
from moe_export.common.errors import EngineDead
from moe_export.runtime.core.contracts import RunnerOutput, StepPlan, VisionPlan
from moe_export.runtime.core.state_offload import AgreePlan, ReadPlan, StateOffload, run_agree, run_load, run_read
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.runner import ModelRunner, StepRefused, VisionRunner
from moe_export.runtime.engine.sampler import SamplingBatch

FAULT_TAG = 7301  # MPI tag of a rank's fault notice to world rank 0
FAULT_POLL_S = 0.05  # how often rank 0's FaultWatch looks for a notice
FAULT_LINGER_S = 2.0  # rank 0: from marking the core dead (503) to aborting the world
FAULT_GRACE_S = 6.0  # a failed rank other than 0: how long rank 0 has to end the world before this rank aborts it
WORLD_BROKEN = threading.Event()  # set in this process once a step's collective part failed on some rank
_NOTICES: list = []  # the fault notices this rank sent (their MPI requests stay alive until the world ends)


Plan = StepPlan | VisionPlan | ReadPlan | AgreePlan


def run_plan(engine: ModelRunner, plan: Plan, sampling: SamplingBatch | None = None,
             offload: StateOffload | None = None) -> RunnerOutput:
    """Apply a plan on this rank: a tower call -> the images' embeddings; an offload read (no step in flight) -> its
    rows; an offload agreement (`state_offload.AgreePlan`, multi-rank) -> nothing (this rank's `offload` holds the
    state or not); a step -> offloaded rows read, slots reset and restored, blocks copied, offloaded state loaded, one runner step
    choosing the tokens of `sampling` (rank 0; None on followers), then the checkpoint saves. A step without chunks
    is an idle step of a dp-layout group (see `runtime.core.wide_ep`)."""
    if isinstance(plan, VisionPlan):
        return RunnerOutput(image_embeds=cast(VisionRunner, engine).encode_images(plan.images))
    if isinstance(plan, AgreePlan):
        run_agree(engine.comm, offload, plan)
        return RunnerOutput()
    reads = [run_read(engine, read) for read in plan.reads]
    if isinstance(plan, ReadPlan):
        return RunnerOutput(reads=reads)
    for slot in plan.resets:
        engine.reset_slot(slot)
    for checkpoint, slot in plan.restores:
        engine.restore_state(slot, checkpoint)
    if plan.copies:
        sources, destinations = zip(*plan.copies)
        engine.write_blocks(list(destinations), engine.read_blocks(list(sources)))
    for load in plan.loads:
        run_load(engine, load, offload)
    width = cast(VisionRunner, engine).image_width if engine.vision is not None else None
    batch = StepBatch.from_sequences(plan.chunks, width) if plan.chunks else None
    out = RunnerOutput(sampled=engine.sample(batch, sampling), reads=reads)
    for slot, checkpoint in plan.saves:
        engine.save_state(slot, checkpoint)
    return out


class PreviousStepFailed(RuntimeError):
    """A planned-ahead step whose input tokens were to come from a step that failed: it does not run."""


class StepExecutor:
    """Rank 0's side of running plans over `engine`: broadcast each plan (multi-rank) and run it here. overlap:
    every plan runs in one worker thread, in order (`submit` returns at once); else `submit` runs it now.
    steps: step plans started so far (tower calls excluded); failed: the latest step run failed. offload: this
    rank's offload store (`core.state_offload`), which loads and agreements use."""

    def __init__(self, engine: ModelRunner, *, overlap: bool, offload: StateOffload | None = None) -> None:
        self.engine = engine
        self.offload = offload
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moe-export-step") if overlap else None
        self.last_ids: np.ndarray | None = None  # the latest sampled ids (fill future tokens)
        self.steps = 0
        self.failed = False

    def execute(self, plan: Plan, sampling: SamplingBatch | None = None) -> RunnerOutput:
        """Broadcast `plan` (multi-rank) and run it on this rank. Under mpiexec a failure other than an agreed
        refusal ends the world (`stop_the_world`) and raises EngineDead: the engine core cannot go on."""
        step = isinstance(plan, StepPlan)
        if step:
            self.steps += 1
        comm = self.engine.comm
        try:
            if comm is not None:
                comm.broadcast(plan)
            out = run_plan(self.engine, plan, sampling, self.offload)
        except BaseException as exc:
            self.failed = self.failed or step
            if comm is None or isinstance(exc, StepRefused):
                raise
            reason = stop_the_world(self.engine, exc)
            raise EngineDead(f"the engine stops: {reason}") from exc
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

    def in_order(self, plan: VisionPlan | ReadPlan | AgreePlan) -> RunnerOutput:
        """Run a plan that is not a step (a tower call, an offload read or agreement) in order with the steps (in
        the worker with overlap) and wait for it."""
        return self.pool.submit(self.execute, plan).result() if self.pool is not None else self.execute(plan)

    def encode(self, plan: VisionPlan) -> list[np.ndarray]:
        """A tower call, in order with the steps."""
        return self.in_order(plan).image_embeds

    def shutdown(self) -> None:
        """Let a step still running finish, then tell follower ranks to leave `follow()` (multi-rank)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.engine.comm is not None:
            self.engine.comm.broadcast(None)


def follow(engine: ModelRunner, offload: StateOffload | None = None) -> int:
    """Non-root ranks: execute rank 0's plans until it shuts down, storing the rows they read in this rank's
    `offload`; returns the number of plans run (a step every rank refused by agreement counts; any other failure
    ends the world)."""
    steps = 0
    while True:
        try:
            plan = engine.comm.broadcast(None)
            if plan is None:
                return steps
            out = run_plan(engine, plan, offload=offload)
            if offload is not None and out.reads:
                offload.reads_done(plan.reads, out.reads)
        except StepRefused:
            pass
        except BaseException as exc:
            stop_the_world(engine, exc)
            raise
        steps += 1


def stop_the_world(engine: ModelRunner, exc: BaseException) -> str:
    """A step's collective part failed on this rank under mpiexec (see the module doc): report which rank and why
    (stderr), send world rank 0 the fault notice (its `FaultWatch` ends the world), and on another rank abort the
    world after FAULT_GRACE_S should rank 0 not have. Returns the reason (rank 0 goes on to fail its core)."""
    world = engine.comm.world
    rank = world.Get_rank()
    reason = f"rank {rank} of {world.Get_size()} failed: {type(exc).__name__}: {exc}"
    if not WORLD_BROKEN.is_set():
        WORLD_BROKEN.set()
        atexit.register(world.Abort, 1)  # a broken world cannot finalize (its collectives are out of step)
        print(f"moe-export: {reason}; stopping all ranks", file=sys.stderr, flush=True)
        _NOTICES.append(world.isend(reason, dest=0, tag=FAULT_TAG))
    if rank != 0:
        time.sleep(FAULT_GRACE_S)
        world.Abort(1)
    return reason


class FaultWatch:
    """World rank 0 under mpiexec: a thread polling for a rank's fault notice (`stop_the_world`). On one it calls
    `on_fault(reason)` (the API marks its engine core dead: /health and every request answer 503), waits
    FAULT_LINGER_S for those answers to go out, then aborts every rank (exit status 1)."""

    def __init__(self, world, on_fault: Callable[[str], None]) -> None:
        self.world, self.on_fault = world, on_fault
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="moe-export-fault-watch", daemon=True)
        self.thread.start()
        atexit.register(self.stop)  # (registered after MPI's start: runs before its finalize)

    def _watch(self) -> None:
        from mpi4py import MPI

        while not self.stopped.wait(FAULT_POLL_S):
            if not self.world.Iprobe(source=MPI.ANY_SOURCE, tag=FAULT_TAG):
                continue
            reason = self.world.recv(source=MPI.ANY_SOURCE, tag=FAULT_TAG)
            WORLD_BROKEN.set()
            try:
                self.on_fault(reason)
            finally:
                time.sleep(FAULT_LINGER_S)
                self.world.Abort(1)

    def stop(self) -> None:
        """End the watch (rank 0's shutdown; a fault being handled still ends the world)."""
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()

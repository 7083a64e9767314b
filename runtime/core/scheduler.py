"""Iteration-level continuous batching: which tokens each engine step runs (`Scheduler.schedule`) and what its
sampled tokens do to the requests (`Scheduler.update`). `core.engine_core.EngineCore` runs the loop (schedule,
execute, update); the scheduler never runs the model.

Each step packs the decode token of every running sequence, then prefill chunks of sequences
still reading their prompt and of newly admitted ones, up to the engine's `max_num_tokens` and, where the
engine sets `max_step_pairs`, up to that many (step token, attended position) pairs: every token of a step
attends to the positions of the step's longest block table, so a long prompt's chunks shrink as its
context grows (a step always holds at least one token; a sequence admitted when the step is full starts
in the next). Finished sequences leave and waiting ones join between steps. A request is admitted when a
recurrent-state slot and the cache blocks for its prompt plus `max_tokens` are free (cached prefix blocks
held by nobody else, then kept sessions, are evicted, least recently used first, to make room); otherwise
it waits, in arrival order. Aborting frees its slot and blocks at once.

A prompt resumes from the longest of: a kept session it exactly extends (`core.sessions`), or a cached prefix
(`core.prefix_cache`: shared cache blocks + a recurrent-state checkpoint copied into its slot). A prefilling
sequence's chunks end at its checkpoint targets, and the state is copied out after that step.

Warm turns (`add_warm`): when a chat whose next prompt departs from its own finishes (K3 renders the tool-choice
message after the conversation, so the model's output was generated after text the next prompt does not hold), the
start of that next prompt (the conversation and the turn as the next prompt renders it) is prefilled as an internal
prefill-only request and kept as a session, so the next turn prefills only its new messages. The total prefill work
is the same; it moves into the gap between turns. A warm turn is admitted only when no request waits, its chunks
take the room the requests leave, it samples and reports nothing, and it gives its slot and blocks up to a request
that needs them; a request whose prompt continues a warm turn waits for it instead of prefilling the same tokens.

Overlap (`overlap=True`): each model step runs in a worker thread, and the host plans and packs step N+1 while
step N runs. A decode row of N+1 whose input is the token N is still choosing carries a future token
(`future_token(j)`: row j of step N's sampled ids), which the worker fills in from N's ids just before N+1 starts, so
the runner waits between steps only for the ids of N, never for the scheduler. Step N+1 is planned ahead only
when nothing in it depends on N's tokens (no grammar, logits processor or output penalty among N's sampled
rows, and no reasoning budget that may force the next token); otherwise it is planned after N's tokens are
applied, while the caller processes N's outputs. A sequence that N finishes (end of sequence, stop string) has
its row of N+1 run anyway: that row feeds N's real last token into the sequence's state (which the kept session
then covers) and its sampled token is dropped; a finish by length is known at planning and gets no row.

Failures stay with the request that caused them: a request whose sampling row cannot be built (its parameters,
reasoning budget or grammar raise), whose logits processor fails, whose token cannot be chosen (the runner's
sampler failing fails the step's sampled rows: `runner.choose_tokens`) or whose output cannot be detokenized ends
without its step failing (finish_reason "abort", `SequenceUpdate.error`; its slot and blocks freed). A runner
exception fails the requests of that step (their slots are freed, so their state is reset for the next user;
with overlap, a step already planned on its tokens fails too) and the core goes on; `max_failed_steps`
failed steps in a row raise `EngineDead` (`core.engine_core`). Any other exception out of a step means the
scheduler itself broke.
Under mpiexec a failed step ends the world at once instead, unless every rank refused it by agreement
(`core.execution`).

Multi-rank (under mpiexec): rank 0 runs this scheduler and broadcasts every step's plan (slot resets,
checkpoint restores and saves, chunks with tokens, positions, slots, block tables); the sampled tokens travel
in the next plan (future tokens are filled in before the broadcast). With overlap, every broadcast and step of
rank 0 runs in the worker thread.
Other ranks run `execution.follow()`, executing the same plans in lockstep. A rank whose step fails prints which
rank and why and tells rank 0, which answers 503 and then aborts the MPI world, so no rank is left waiting in a
collective (`core.execution`).

Modules: this one schedules (admission order, chunking, planning ahead, applying tokens); `core.resources` holds
slots, blocks, the prefix cache and sessions; `core.rows` builds sampling rows; `core.execution` runs plans;
`core.engine_core` composes them into one step.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from moe_export.common.errors import InputError
from moe_export.runtime.core.contracts import (
    Request,
    SequenceUpdate,
    StepPlan,
    future_token,
)
from moe_export.runtime.core.resources import CheckpointSave, Resources
from moe_export.runtime.core.rows import SamplingRow, build_row, pack_rows
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.core.state_offload import StateOffload
from moe_export.runtime.engine.batch import SequenceChunk
from moe_export.runtime.engine.runner import ModelRunner, VisionRunner
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class RunnerLimits:
    """What the scheduler plans against, read from the runner once (the scheduler holds no runner).
    max_seq_len / max_num_tokens: tokens; max_step_pairs: (step token, attended position) pairs per step or None;
    vocab_size: the model's vocabulary (None when its config has none); vision: the engine has a tower;
    media_pad_id: the `<|media_pad|>` token id of a vision engine."""

    max_seq_len: int
    max_num_tokens: int
    max_step_pairs: int | None
    vocab_size: int | None
    vision: bool
    media_pad_id: int | None

    @classmethod
    def of(cls, engine: ModelRunner) -> RunnerLimits:
        cfg = engine.model_config or {}
        vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
        return cls(engine.max_seq_len, engine.max_num_tokens, engine.max_step_pairs, int(vocab) if vocab else None,
                   engine.vision is not None, cast(VisionRunner, engine).media_pad_id if engine.vision else None)


@dataclass
class ScheduledRow:
    """One sequence's part in a step: its chunk, its sampling row when the step chooses its next token (None
    mid-prompt), that row's index among the step's sampled rows, and whether the chunk's last token is a future
    token (overlap: the token the step in flight is choosing)."""

    seq: Sequence
    chunk: SequenceChunk
    future: bool = False
    sampling: SamplingRow | None = None
    sample_index: int = -1


@dataclass
class ScheduledStep:
    """What `Scheduler.schedule()` decided for one step: the updates of requests that ended before it (aborts,
    failures), its rows (none: nothing runnable), the plan every rank runs, the packed sampling rows (rank 0) and
    the checkpoint saves the plan makes."""

    updates: list[SequenceUpdate]
    rows: list[ScheduledRow] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)
    sampling: SamplingBatch | None = None
    saves: list[CheckpointSave] = field(default_factory=list)

    @property
    def futures(self) -> list[SequenceChunk]:
        """The chunks whose last token is a future token (filled in by the executor before the step runs)."""
        return [r.chunk for r in self.rows if r.future]

    @property
    def sampled(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.sampling is not None]


class Scheduler:
    """Continuous batching on rank 0: plans steps (`schedule`) and applies what they sampled (`update`); it never
    runs the model (`core.engine_core.EngineCore` does, through its executor).

    engine: the runner whose limits, slots and blocks are planned for (read at construction, not kept).
    eos_token_ids: the model's stop ids (ignored per request with `ignore_eos`). text_decoder: makes an
    `IncrementalDecoder` (output ids -> text, a step at a time): each output is detokenized once, here, for its
    stop strings and its `SequenceUpdate.text` alike. keep_sessions: keep finished sequences' state for reuse.
    prefix_caching: share cached prefixes across requests (`core.prefix_cache`; off when the runner has no
    checkpoint pool). offload: the offload store of prefix state (`core.state_offload`; with prefix caching
    only). sample_vocab: sample among ids below it only (the tokenizer's size when the model's
    vocabulary has padding rows). overlap: plan a step while the previous one runs (future tokens, see the
    module doc)."""

    def __init__(self, engine: ModelRunner, *, eos_token_ids=(), text_decoder=None, keep_sessions: bool = True,
                 prefix_caching: bool = True, sample_vocab: int | None = None, overlap: bool = False,
                 offload: StateOffload | None = None) -> None:
        self.limits = RunnerLimits.of(engine)
        self.overlap = overlap
        self.resources = Resources(engine, keep_sessions=keep_sessions, prefix_caching=prefix_caching, offload=offload)
        self.sample_vocab = sample_vocab
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text_decoder = text_decoder
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids: set[str] = set()
        self._ended: list[SequenceUpdate] = []  # requests that ended between steps (aborts, failures)
        # warm turns (see `add_warm`): queued, and admitted ones prefilling (by request id, in admission order)
        self.warm_queue: deque[Sequence] = deque()
        self.warm_running: dict[str, Sequence] = {}
        self.max_warm = engine.num_slots  # queued warm turns beyond it: the oldest is dropped
        self.warm_prefill_tokens = 0  # tokens warm turns fed (prefill work done between turns, not by requests)
        self.warm_turns = 0  # warm turns prefilled to their end (kept as sessions)
        self.warm_dropped = 0  # warm turns given up (their slot or blocks needed, or not admissible)

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; InputError if it can never run (empty or too long prompt, unknown ids, duplicate id)."""
        self.waiting.append(self.check(request))
        self._ids.add(request.request_id)

    def add_warm(self, request: Request) -> None:
        """Queue a warm turn: a prefill-only internal request (the start of a chat's next prompt: its conversation and
        the turn that just finished, `RequestCore`), run at low priority and kept as a session at its end, so the
        next prompt resumes after the model's own output. It is admitted only when no request waits (or at once when
        the request at the head of the queue continues it: that request then waits for it rather than prefilling the
        same tokens itself), its chunks go after the requests' own, no token is sampled and nothing is reported;
        it is dropped when a request needs its slot or blocks. A prompt that can never run is ignored."""
        try:
            seq = self.check(request)
        except InputError:
            return
        seq.text = None
        self._ids.add(request.request_id)
        self.warm_queue.append(seq)
        while len(self.warm_queue) > self.max_warm:
            self._drop_warm(self.warm_queue.popleft())

    def _drop_warm(self, seq: Sequence) -> None:
        """Give up a warm turn (queued or admitted): its slot and blocks freed."""
        self.warm_running.pop(seq.request_id, None)
        self._ids.discard(seq.request_id)
        self.resources.release(seq, keep=False)
        self.warm_dropped += 1

    def _continued_warm(self, seq: Sequence, resets: list[int], restores: list[tuple[int, int]]) -> bool:
        """Whether `seq`'s prompt continues a warm turn's prompt that is prefilling, or queued (then admitted now):
        `seq` waits for it. A queued one that cannot be admitted is dropped."""
        def continues(warm: Sequence) -> bool:
            n = len(warm.tokens)
            return n < len(seq.tokens) and np.array_equal(seq.session_key(n), warm.session_key(n))

        if any(continues(w) for w in self.warm_running.values()):
            return True
        warm = next((w for w in self.warm_queue if continues(w)), None)
        if warm is None:
            return False
        self.warm_queue.remove(warm)
        if self.resources.admit(warm, resets, restores, warm=True):
            self.warm_running[warm.request_id] = warm
            return True
        self._drop_warm(warm)
        return False

    def check(self, request: Request) -> Sequence:
        """The sequence of a request this scheduler could run (not queued); InputError if it can never run."""
        n, rid = len(request.prompt_ids), request.request_id
        if n == 0:
            raise InputError(f"request {rid}: the prompt must contain at least one token")
        limit = self.limits.max_seq_len
        if n >= limit:
            raise InputError(
                f"request {rid}: the prompt has {n} tokens; the engine's max_seq_len is {limit} "
                f"(at most {limit - 1} prompt tokens, leaving room for one generated token)"
            )
        vocab = self.vocab_size
        if vocab is not None:
            bad = [t for t in request.prompt_ids if not 0 <= int(t) < vocab]
            if bad:
                raise InputError(f"request {rid}: token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if request.sampling.stop and self.text_decoder is None:
            raise InputError(f"request {rid}: stop strings need a tokenizer")
        if rid in self._ids:
            raise InputError(f"request id {rid!r} is already in use")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(62)
        seq = Sequence(request, [int(t) for t in request.prompt_ids], n, seed)
        if request.images:
            self._check_images(seq)
        if self.text_decoder is not None:
            seq.text = self.text_decoder()
        need = self.resources.blocks_for(seq)
        if need > self.resources.allocator.num_blocks:
            raise InputError(f"request {rid}: prompt + max_tokens needs {need} cache blocks; "
                             f"the engine has {self.resources.allocator.num_blocks}")
        return seq

    def _check_images(self, seq: Sequence) -> None:
        """An image request: the engine has a tower, and the prompt's `<|media_pad|>` runs match the images."""
        req = seq.request
        if not self.limits.vision:
            raise InputError(f"request {req.request_id}: this engine has no vision tower (text only); "
                             "image input needs a K3 engine built with its vision_config")
        ids = np.asarray(seq.tokens)
        pads = np.flatnonzero(ids == self.limits.media_pad_id)
        want = sum(im.num_tokens for im in req.images)
        if len(pads) != want:
            raise InputError(f"request {req.request_id}: the prompt holds {len(pads)} <|media_pad|> tokens, its "
                             f"{len(req.images)} image(s) need {want}")
        seq.pad_positions = pads
        key = ids.tolist()
        start = 0
        for im in req.images:  # one stand-in id per image, negative so it never equals a token id
            stand_in = -1 - int(im.digest[:15] or "0", 16)
            for p in pads[start:start + im.num_tokens]:
                key[p] = stand_in
            start += im.num_tokens
        seq.key_prefix = tuple(key)

    def awaiting_images(self) -> list[Sequence]:
        """Waiting sequences whose images have no embeddings yet (the engine core runs the tower for them)."""
        return [s for s in self.waiting if s.request.images and s.image_embeds is None]

    def images_encoded(self, seqs: list[Sequence], embeds: dict[str, np.ndarray]) -> None:
        """Give `seqs` their images' embeddings (`embeds`: image digest -> [tokens, hidden])."""
        for s in seqs:
            s.image_embeds = np.concatenate([embeds[im.digest] for im in s.request.images])

    def images_failed(self, seqs: list[Sequence], exc: BaseException) -> None:
        """The tower call for `seqs` failed: those requests fail, like a failing step's."""
        for s in seqs:
            self._ended.append(self._fail(s, f"the vision tower failed: {describe(exc)}"))

    @property
    def vocab_size(self) -> int | None:
        return self.limits.vocab_size

    def abort(self, request_id: str) -> bool:
        """Drop a request now (its slot and blocks freed); reported as finished with reason "abort"."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq, keep=False)
                    self._ended.append(self._flushed(seq, SequenceUpdate(request_id, [], None, True, "abort")))
                    return True
        return False

    def _fail(self, seq: Sequence, error: str) -> SequenceUpdate:
        """End `seq` because of `error` (no more text: its decoder is not flushed); its slot and blocks are freed."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self._release(seq, keep=False)
        return SequenceUpdate(seq.request_id, [], None, True, "abort", error=error, cached_tokens=seq.cached_tokens)

    def requeue_ended(self, updates: list[SequenceUpdate]) -> None:
        """Updates of a step that was not run (nothing runnable yet): they go out with the next step."""
        self._ended[:0] = updates

    def _release(self, seq: Sequence, keep: bool) -> None:
        self._ids.discard(seq.request_id)
        self.resources.release(seq, keep)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self.warm_queue or self.warm_running)

    @property
    def load(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), **self.resources.stats(),
                "warm_prefill_tokens": self.warm_prefill_tokens, "warm_turns": self.warm_turns,
                "warm_dropped": self.warm_dropped}

    # ---- one iteration --------------------------------------------------------------------------

    def _chunk_len(self, seq: Sequence, step_tokens: int, step_blocks: int) -> int:
        """How many of `seq`'s pending tokens join a step already holding `step_tokens` tokens whose longest
        block table has `step_blocks` blocks: within max_num_tokens and max_step_pairs (at least 1 in an empty step)."""
        n = min(len(seq.tokens) + seq.pending - seq.num_computed, self.limits.max_num_tokens - step_tokens)
        if seq.targets:  # a prefill chunk ends at the next checkpoint target
            n = min(n, seq.targets[0] - seq.num_computed)
        max_pairs = self.limits.max_step_pairs
        if max_pairs is None or n <= 0:
            return max(n, 0)
        allocator = self.resources.allocator

        def pairs(k: int) -> int:
            blocks = max(step_blocks, allocator.blocks_needed(seq.num_computed + k))
            return (step_tokens + k) * blocks * allocator.block_size

        lo, hi = 0, n  # pairs() grows with k: the largest k in [0, n] within the budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pairs(mid) <= max_pairs else (lo, mid - 1)
        return lo if lo > 0 or step_tokens > 0 else 1

    def _plan(self, resets: list[int], restores: list[tuple[int, int]]) -> list[ScheduledRow]:
        """The step's rows, in step order: decode rows, prefill chunks, then newly admitted sequences (their slot
        resets and checkpoint restores appended to `resets` / `restores`)."""
        rows: list[ScheduledRow] = []
        step_tokens = step_blocks = 0

        def add_chunk(seq: Sequence) -> bool:
            """Schedule `seq`'s next chunk; False when no token of it fits in this step."""
            nonlocal step_tokens, step_blocks
            n = self._chunk_len(seq, step_tokens, step_blocks)
            if n == 0:
                return False
            table = seq.block_ids[: self.resources.allocator.blocks_needed(seq.num_computed + n)]
            tokens = seq.tokens[seq.num_computed: seq.num_computed + n]
            row = ScheduledRow(seq, SequenceChunk(seq.slot, seq.num_computed, tokens, table))
            if len(tokens) < n:  # planned ahead: its input is the token the step in flight is choosing
                tokens.append(future_token(seq.future_row))
                row.future = True
            if seq.pad_positions is not None:  # the chunk's image rows and their embeddings
                lo, hi = np.searchsorted(seq.pad_positions, [seq.num_computed, seq.num_computed + n])
                row.chunk.image_rows = (seq.pad_positions[lo:hi] - seq.num_computed).tolist()
                row.chunk.image_embeds = seq.image_embeds[lo:hi]
            rows.append(row)
            step_tokens, step_blocks = step_tokens + n, max(step_blocks, len(table))
            return True

        decoding = [s for s in self.running if len(s.tokens) + s.pending - s.num_computed == 1]
        prefilling = [s for s in self.running if len(s.tokens) + s.pending - s.num_computed > 1]
        if self.overlap:  # a pending token that ends its sequence by length (known now, unlike an eos): no row
            limit = self.limits.max_seq_len
            decoding = [s for s in decoding if not s.pending or (
                len(s.tokens) + 1 - s.prompt_len < s.request.sampling.max_tokens and len(s.tokens) + 1 < limit)]
        for seq in decoding + prefilling:
            if not add_chunk(seq):
                return rows
        while self.waiting and step_tokens < self.limits.max_num_tokens:
            seq = self.waiting[0]
            if self._continued_warm(seq, resets, restores):
                break
            if not self.resources.admit(seq, resets, restores):
                if not self.warm_running:
                    break
                self._drop_warm(next(reversed(self.warm_running.values())))  # its slot / blocks go to the request
                continue
            self.waiting.popleft()
            self.running.append(seq)
            if not add_chunk(seq):
                return rows
        while not self.waiting and self.warm_queue and step_tokens < self.limits.max_num_tokens:
            seq = self.warm_queue[0]
            if self.resources.admit(seq, resets, restores, warm=True):
                self.warm_running[self.warm_queue.popleft().request_id] = seq
            elif self.running or self.warm_running:  # the slots are busy: later
                break
            else:  # it can never run alone
                self._drop_warm(self.warm_queue.popleft())
        for seq in self.warm_running.values():  # after the requests' chunks: the step's room left
            before = step_tokens
            if seq.num_computed < len(seq.tokens) and not add_chunk(seq):
                break
            self.warm_prefill_tokens += step_tokens - before
        return rows

    def can_plan_ahead(self, step: ScheduledStep) -> bool:
        """Whether the step after `step` (started, its tokens not in) can be planned now: overlap is on and no
        sequence sampled in `step` needs its token to build its next sampling row (grammar bitmask, logits
        processor, output penalties, a reasoning budget that may force the next token)."""
        if not self.overlap:
            return False
        sampled = step.sampled
        if not sampled:
            return False
        for row in sampled:
            req = row.seq.request
            if req.logits_processors or req.sampling.penalized:
                return False
            if req.budget is not None and req.budget.may_force_next():
                return False
        return True

    def _build_rows(self, rows: list[ScheduledRow]) -> None:
        """The sampling rows of the step's sequences that get a token; a sequence whose row cannot be built is
        failed (its slot released)."""
        for row in rows:
            seq = row.seq
            if seq.num_computed + len(row.chunk.tokens) < len(seq.tokens) + seq.pending:
                continue  # mid-prompt
            if seq.request_id in self.warm_running:
                continue  # a warm turn samples nothing
            try:
                row.sampling = build_row(seq, self.eos_token_ids, self.vocab_size)
            except Exception as exc:
                self._ended.append(self._fail(seq, f"its sampling row could not be built: {describe(exc)}"))

    def schedule(self) -> ScheduledStep:
        """Plan one step: admission, chunks, sampling rows packed, checkpoint saves. A step without rows has
        nothing to run (it carries the updates of requests that ended before it)."""
        resets: list[int] = []
        restores: list[tuple[int, int]] = []
        rows = self._plan(resets, restores)
        self._build_rows(rows)
        rows = [r for r in rows if r.seq.slot >= 0]  # (a failed row's sequence is released)
        updates, self._ended = self._ended, []
        if not rows:
            if self.waiting and not self.running and not self.warm_running and not updates:
                raise RuntimeError("the scheduler cannot admit any waiting request although nothing runs")
            return ScheduledStep(updates)
        saves = self.resources.checkpoint_saves([r.seq for r in rows], [r.chunk for r in rows])
        for r in rows:
            r.seq.num_computed += len(r.chunk.tokens)
        positions = [n for n, r in enumerate(rows) if r.sampling is not None]
        for j, n in enumerate(positions):
            rows[n].sample_index = j
            if self.overlap:  # (without overlap no step is planned before the previous one's tokens are in)
                rows[n].seq.pending += 1
                rows[n].seq.future_row = j
        sampling = (pack_rows([rows[n].sampling for n in positions], positions, self.sample_vocab)
                    if positions else None)
        plan = StepPlan(resets, restores, [r.chunk for r in rows], [(s.slot, s.checkpoint) for s in saves],
                        *self.resources.offload_io(), copies=self.resources.take_copies())
        return ScheduledStep(updates, rows, plan, sampling, saves)

    def update(self, step: ScheduledStep, sampled: SampledTokens | None, reads: list | None = None) -> list[SequenceUpdate]:
        """Apply a step that ran: store the state rows it read for the offload store (`reads`), name its blocks,
        commit its checkpoints and take its sampled tokens (sequences aborted while it ran are skipped); the updates
        of the step."""
        self.resources.offload_read(step.plan.reads, reads)
        for r in step.rows:
            if r.seq.slot >= 0:  # (a released sequence's state is no longer followed)
                self.resources.name_blocks(r.seq, r.chunk.start + len(r.chunk.tokens))
        if self.resources.prefix is not None:
            self.resources.commit_saves(step.saves)
        for r in step.rows:  # a warm turn prefilled to its end: kept as a session
            seq = r.seq
            if seq.request_id in self.warm_running and seq.slot >= 0 and r.chunk.start + len(r.chunk.tokens) == len(seq.tokens):
                del self.warm_running[seq.request_id]
                self._release(seq, keep=True)
                self.warm_turns += 1
        for r in step.sampled:
            if r.seq.slot >= 0:
                step.updates.append(self._take(r.seq, sampled, r.sample_index))
        return step.updates

    def step_failed(self, step: ScheduledStep, exc: BaseException) -> list[SequenceUpdate]:
        """A step raised: its sequences fail (their slots and blocks freed, so their state is reset for the next
        user), its checkpoints are given back unnamed; the updates of the step."""
        if self.resources.prefix is not None:
            self.resources.drop_saves(step.saves)
        self.resources.offload_read(step.plan.reads, None)
        for r in step.rows:
            if r.seq.request_id in self.warm_running:
                self._drop_warm(r.seq)
            elif r.seq.slot >= 0:
                step.updates.append(self._fail(r.seq, f"an engine step it was in failed: {describe(exc)}"))
        return step.updates

    def _take(self, seq: Sequence, out: SampledTokens, j: int) -> SequenceUpdate:
        """Apply row j of the step's sampled tokens to `seq`: stop checks, budget, the update."""
        req, params = seq.request, seq.request.sampling
        if j in out.errors:  # a failing request-supplied logits processor, or nothing allowed: that request ends
            return self._fail(seq, out.errors[j])
        token = int(out.ids[j])
        logprob = out.logprobs[j]
        seq.tokens.append(token)
        if seq.pending:
            seq.pending -= 1
        update = SequenceUpdate(req.request_id, [token], [logprob] if logprob is not None else None,
                                cached_tokens=seq.cached_tokens,
                                top_logprobs=[out.top_logprobs[j]] if params.logprobs else None)
        try:
            if req.budget is not None:
                req.budget.observe(token)
            self._stop_check(seq, update, token)
        except Exception as exc:
            return self._fail(seq, f"its output could not be decoded: {describe(exc)}")
        n_out = len(seq.tokens) - seq.prompt_len
        if update.finish_reason is None and (n_out >= params.max_tokens or len(seq.tokens) >= self.limits.max_seq_len):
            update.finish_reason = "length"
        if update.finish_reason is not None:
            update.finished = True
            self.running.remove(seq)
            self._release(seq, keep=True)
            self._flushed(seq, update)
        return update

    def _stop_check(self, seq: Sequence, update: SequenceUpdate, token: int) -> None:
        """A stop token or stop string ends the output; the new token's text goes into the update."""
        params = seq.request.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            update.finish_reason = "stop"
        elif seq.text is not None:
            piece = update.text = seq.text.push([token])
            update.text_complete = not seq.text.holding
            if params.stop:  # only the new text and what a stop string may have begun in before it: O(1) a step
                window = seq.text_tail + piece
                hits = [i for i in (window.find(s) for s in params.stop) if i >= 0]
                if hits:
                    update.finish_reason, update.stop_text_index = "stop", seq.text_len - len(seq.text_tail) + min(hits)
                seq.text_tail = window[max(len(window) - params.longest_stop + 1, 0):]
            seq.text_len += len(piece)

    @staticmethod
    def _flushed(seq: Sequence, update: SequenceUpdate) -> SequenceUpdate:
        """A finishing update with the decoder's held rest (an unfinished character) appended to its text (a
        decoder that fails there ends the request with that error)."""
        if seq.text is not None:
            try:
                update.text += seq.text.flush()
            except Exception as exc:
                update.finish_reason, update.error = "abort", f"its output could not be decoded: {describe(exc)}"
            update.text_complete = True
        return update

"""Iteration-level continuous batching over an engine's `step` (the runtime's one generation loop).

Each `step()` packs the decode token of every running sequence, then prefill chunks of sequences
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
with overlap, a step already planned on its tokens fails too) and the scheduler goes on; `max_failed_steps`
failed steps in a row raise `EngineDead`. Any other exception out of `step()` means the scheduler itself broke.
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
slots, blocks, the prefix cache and sessions; `core.rows` builds sampling rows; `core.execution` runs plans.
"""

from __future__ import annotations

import secrets
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from moe_export.common.errors import EngineDead, InputError
from moe_export.runtime.core.contracts import (
    Request,
    SequenceUpdate,
    StepPlan,
    VisionPlan,
    future_token,
)
from moe_export.runtime.core.execution import PreviousStepFailed, StepExecutor
from moe_export.runtime.core.resources import CheckpointSave, Resources
from moe_export.runtime.core.rows import SamplingRow, build_row, pack_rows
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.engine.batch import SequenceChunk
from moe_export.runtime.engine.runner import ModelRunner, VisionRunner

MAX_FAILED_STEPS = 3  # runner failures in a row after which the engine core is dead


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _Flight:
    """A started step: the updates it carries (requests that ended before it), what it runs, and its future."""

    updates: list[SequenceUpdate]
    scheduled: list[Sequence] = field(default_factory=list)
    chunks: list[SequenceChunk] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    saves: list[CheckpointSave] = field(default_factory=list)
    future: Future | None = None


class Scheduler:
    """Continuous batching on rank 0 of `engine`.

    eos_token_ids: the model's stop ids (ignored per request with `ignore_eos`). text_decoder: makes an
    `IncrementalDecoder` (output ids -> text, a step at a time): each output is detokenized once, here, for its
    stop strings and its `SequenceUpdate.text` alike. keep_sessions: keep finished sequences' state for reuse.
    prefix_caching: share cached prefixes across requests (`core.prefix_cache`; off when the runner has no
    checkpoint pool). sample_vocab: sample among ids below it only (the tokenizer's size when the model's
    vocabulary has padding rows). max_failed_steps: runner failures in a row that make `step()` raise EngineDead."""

    def __init__(self, engine: ModelRunner, *, eos_token_ids=(), text_decoder=None, keep_sessions: bool = True,
                 prefix_caching: bool = True, sample_vocab: int | None = None, overlap: bool = False,
                 max_failed_steps: int = MAX_FAILED_STEPS) -> None:
        self.engine = engine
        # overlap: model steps (and, multi-rank, their broadcasts) run in one worker thread, in order; `step()`
        # returns with the next step already started (see the module doc)
        self.overlap = overlap
        self.executor = StepExecutor(engine, overlap=overlap)
        self.resources = Resources(engine, keep_sessions=keep_sessions, prefix_caching=prefix_caching)
        self._flight: _Flight | None = None
        self.planned_ahead = 0  # steps planned while the previous one ran (overlap)
        self.sample_vocab = sample_vocab
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text_decoder = text_decoder
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # runner failures in a row
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids: set[str] = set()
        self._ended: list[SequenceUpdate] = []  # requests that ended between steps (aborts, failures)

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; InputError if it can never run (empty or too long prompt, unknown ids, duplicate id)."""
        self.waiting.append(self.check(request))
        self._ids.add(request.request_id)

    def check(self, request: Request) -> Sequence:
        """The sequence of a request this scheduler could run (not queued); InputError if it can never run."""
        n, rid = len(request.prompt_ids), request.request_id
        if n == 0:
            raise InputError(f"request {rid}: the prompt must contain at least one token")
        limit = self.engine.max_seq_len
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
        if self.engine.vision is None:
            raise InputError(f"request {req.request_id}: this engine has no vision tower (text only); "
                             "image input needs a K3 engine built with its vision_config")
        ids = np.asarray(seq.tokens)
        pads = np.flatnonzero(ids == cast(VisionRunner, self.engine).media_pad_id)
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

    def _encode_images(self) -> None:
        """Run the tower for waiting requests whose images have no embeddings yet (cache hits first, the rest in
        one packed call). A failing call fails those requests, like a failing step."""
        pending = [s for s in self.waiting if s.request.images and s.image_embeds is None]
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
                for s in pending:
                    self._ended.append(self._fail(s, f"the vision tower failed: {_describe(exc)}"))
                return
            for im, emb in zip(missing, out):
                found[im.digest] = emb
                vision.store(im.digest, emb)
        for s in pending:
            s.image_embeds = np.concatenate([found[im.digest] for im in s.request.images])

    @property
    def vocab_size(self) -> int | None:
        cfg = self.engine.model_config or {}
        vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
        return int(vocab) if vocab else None

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

    def _release(self, seq: Sequence, keep: bool) -> None:
        self._ids.discard(seq.request_id)
        self.resources.release(seq, keep)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._flight is not None)

    @property
    def load(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def stats(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), **self.resources.stats()}

    # ---- one iteration --------------------------------------------------------------------------

    def _chunk_len(self, seq: Sequence, step_tokens: int, step_blocks: int) -> int:
        """How many of `seq`'s pending tokens join a step already holding `step_tokens` tokens whose longest
        block table has `step_blocks` blocks: within max_num_tokens and max_step_pairs (at least 1 in an empty step)."""
        n = min(len(seq.tokens) + seq.pending - seq.num_computed, self.engine.max_num_tokens - step_tokens)
        if seq.targets:  # a prefill chunk ends at the next checkpoint target
            n = min(n, seq.targets[0] - seq.num_computed)
        max_pairs = self.engine.max_step_pairs
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

    def _plan(self) -> tuple[list[int], list[tuple[int, int]], list[Sequence], list[SequenceChunk], list[SequenceChunk]]:
        """(slots to reset, (checkpoint, slot) restores, scheduled sequences, their chunks, the chunks whose last
        token is a future token)."""
        resets: list[int] = []
        restores: list[tuple[int, int]] = []
        scheduled: list[Sequence] = []
        chunks: list[SequenceChunk] = []
        futures: list[SequenceChunk] = []
        step_tokens = step_blocks = 0

        def add_chunk(seq: Sequence) -> bool:
            """Schedule `seq`'s next chunk; False when no token of it fits in this step."""
            nonlocal step_tokens, step_blocks
            n = self._chunk_len(seq, step_tokens, step_blocks)
            if n == 0:
                return False
            table = seq.block_ids[: self.resources.allocator.blocks_needed(seq.num_computed + n)]
            tokens = seq.tokens[seq.num_computed: seq.num_computed + n]
            chunk = SequenceChunk(seq.slot, seq.num_computed, tokens, table)
            if len(tokens) < n:  # planned ahead: its input is the token the step in flight is choosing
                tokens.append(future_token(seq.future_row))
                futures.append(chunk)
            if seq.pad_positions is not None:  # the chunk's image rows and their embeddings
                lo, hi = np.searchsorted(seq.pad_positions, [seq.num_computed, seq.num_computed + n])
                chunk.image_rows = (seq.pad_positions[lo:hi] - seq.num_computed).tolist()
                chunk.image_embeds = seq.image_embeds[lo:hi]
            chunks.append(chunk)
            scheduled.append(seq)
            step_tokens, step_blocks = step_tokens + n, max(step_blocks, len(table))
            return True

        decoding = [s for s in self.running if len(s.tokens) + s.pending - s.num_computed == 1]
        prefilling = [s for s in self.running if len(s.tokens) + s.pending - s.num_computed > 1]
        if self.overlap:  # a pending token that ends its sequence by length (known now, unlike an eos): no row
            limit = self.engine.max_seq_len
            decoding = [s for s in decoding if not s.pending or (
                len(s.tokens) + 1 - s.prompt_len < s.request.sampling.max_tokens and len(s.tokens) + 1 < limit)]
        for seq in decoding + prefilling:
            if not add_chunk(seq):
                return resets, restores, scheduled, chunks, futures
        while (self.waiting and step_tokens < self.engine.max_num_tokens
               and self.resources.admit(self.waiting[0], resets, restores)):
            seq = self.waiting.popleft()
            self.running.append(seq)
            if not add_chunk(seq):
                break
        return resets, restores, scheduled, chunks, futures

    def step(self) -> list[SequenceUpdate]:
        """Run one engine step (if anything is runnable); returns the updates it produced. With overlap the
        step after it is already running when this returns (planned while this one ran where nothing in it
        needed this step's tokens, else planned from them), so processing the updates overlaps it; a request
        aborted meanwhile has its token of that step dropped. EngineDead after `max_failed_steps` failed steps
        in a row."""
        flight = self._flight if self._flight is not None else self._start()
        self._flight = None
        if self._can_plan_ahead(flight):
            ahead = self._start()
            if ahead.chunks:
                self._flight = ahead
                self.planned_ahead += 1
            else:  # nothing runnable before the flight's tokens are in: plan again after them
                self._ended[:0] = ahead.updates
        updates = self._finish(flight)
        if self.overlap and self._flight is None and self.has_work:
            self._flight = self._start()
        return updates

    def _can_plan_ahead(self, flight: _Flight) -> bool:
        """Whether the step after `flight` can be planned before its tokens are known: overlap is on, the last
        step run did not fail, and no sequence sampled in `flight` needs its token to build its next sampling
        row (grammar bitmask, logits processor, output penalties, a reasoning budget that may force the next
        token)."""
        if not (self.overlap and flight.rows) or self.executor.failed:
            return False
        for n in flight.rows:
            req = flight.scheduled[n].request
            if req.logits_processors or req.sampling.penalized:
                return False
            if req.budget is not None and req.budget.may_force_next():
                return False
        return True

    def _sampled(self, scheduled: list[Sequence], chunks: list[SequenceChunk]) -> dict[int, SamplingRow]:
        """The sampling rows of the step's sequences that get a token, by step position; a sequence whose row
        cannot be built is failed (and left out)."""
        rows: dict[int, SamplingRow] = {}
        for n, (seq, chunk) in enumerate(zip(scheduled, chunks)):
            if seq.num_computed + len(chunk.tokens) < len(seq.tokens) + seq.pending:
                continue  # mid-prompt
            try:
                rows[n] = build_row(seq, self.eos_token_ids, self.vocab_size)
            except Exception as exc:
                self._ended.append(self._fail(seq, f"its sampling row could not be built: {_describe(exc)}"))
        return rows

    def _start(self) -> _Flight:
        """Plan one step and start it (in the worker thread with overlap)."""
        self._encode_images()
        resets, restores, scheduled, chunks, futures = self._plan()
        rows = self._sampled(scheduled, chunks)
        keep = [n for n, seq in enumerate(scheduled) if seq.slot >= 0]  # (a failed row's sequence is released)
        if len(keep) < len(scheduled):
            dropped = {id(chunks[n]) for n in range(len(chunks)) if n not in keep}
            futures = [c for c in futures if id(c) not in dropped]
            rows = {keep.index(n): row for n, row in rows.items()}
            scheduled, chunks = [scheduled[n] for n in keep], [chunks[n] for n in keep]
        updates, self._ended = self._ended, []
        if not chunks:
            if self.waiting and not self.running and not updates:
                raise RuntimeError("the scheduler cannot admit any waiting request although nothing runs")
            return _Flight(updates)
        saves = self.resources.checkpoint_saves(scheduled, chunks)
        for seq, chunk in zip(scheduled, chunks):
            seq.num_computed += len(chunk.tokens)
        positions = sorted(rows)
        sampling = pack_rows([rows[n] for n in positions], positions, self.sample_vocab) if positions else None
        if self.overlap:  # (without overlap no step is planned before the previous one's tokens are in)
            for j, n in enumerate(positions):
                scheduled[n].pending += 1
                scheduled[n].future_row = j
        plan = StepPlan(resets, restores, chunks, [(s.slot, s.checkpoint) for s in saves])
        future = self.executor.submit(plan, sampling, futures)
        return _Flight(updates, scheduled, chunks, positions, saves, future)

    def _finish(self, flight: _Flight) -> list[SequenceUpdate]:
        """Wait for a started step and apply its tokens (sequences aborted while it ran are skipped); a failed
        step fails its sequences instead."""
        if not flight.chunks:
            return flight.updates
        try:
            out = flight.future.result().sampled
        except Exception as exc:
            return self._step_failed(flight, exc)
        self.failed_steps = 0
        for seq, chunk in zip(flight.scheduled, flight.chunks):
            if seq.slot >= 0:  # (a released sequence's state is no longer followed)
                self.resources.name_blocks(seq, chunk.start + len(chunk.tokens))
        if self.resources.prefix is not None:
            self.resources.commit_saves(flight.saves)
        for j, n in enumerate(flight.rows):
            if flight.scheduled[n].slot >= 0:
                flight.updates.append(self._take(flight.scheduled[n], out, j))
        return flight.updates

    def _count_failure(self, exc: BaseException) -> None:
        """One more runner failure in a row (a step skipped for its predecessor's failure is not one); an
        EngineDead (under mpiexec: a step failed on some rank, the world ends) kills the core at once."""
        if isinstance(exc, EngineDead):
            raise exc
        if not isinstance(exc, PreviousStepFailed):
            self.failed_steps += 1
        if self.failed_steps >= self.max_failed_steps:
            raise EngineDead(f"{self.failed_steps} engine steps in a row failed, the last with {_describe(exc)}") from exc

    def _step_failed(self, flight: _Flight, exc: Exception) -> list[SequenceUpdate]:
        """A step raised: its sequences fail (their slots and blocks freed, so their state is reset for the next
        user), its checkpoints are given back unnamed."""
        if self.resources.prefix is not None:
            self.resources.drop_saves(flight.saves)
        for seq in flight.scheduled:
            if seq.slot >= 0:
                flight.updates.append(self._fail(seq, f"an engine step it was in failed: {_describe(exc)}"))
        self._count_failure(exc)
        return flight.updates

    def _take(self, seq: Sequence, out, j: int) -> SequenceUpdate:
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
            return self._fail(seq, f"its output could not be decoded: {_describe(exc)}")
        n_out = len(seq.tokens) - seq.prompt_len
        if update.finish_reason is None and (n_out >= params.max_tokens or len(seq.tokens) >= self.engine.max_seq_len):
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
                update.finish_reason, update.error = "abort", f"its output could not be decoded: {_describe(exc)}"
            update.text_complete = True
        return update

    def shutdown(self) -> None:
        """Let a step still running finish (overlap), then tell follower ranks to leave `follow()` (rank 0,
        multi-rank only)."""
        self._flight = None
        self.executor.shutdown()

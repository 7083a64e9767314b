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

Multi-rank (under mpiexec): rank 0 runs this scheduler and broadcasts every step's plan (slot resets,
checkpoint restores and saves, chunks with tokens, positions, slots, block tables); the sampled tokens travel
in the next plan (future tokens are filled in before the broadcast). With overlap, every broadcast and step of
rank 0 runs in the worker thread.
Other ranks run `follow()`, executing the same plans in lockstep. A rank that fails prints which rank
and why, then aborts the MPI world, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from moe_export.common.errors import InputError
from moe_export.runtime.core.blocks import BlockAllocator
from moe_export.runtime.core.prefix_cache import PrefixCache, block_hashes
from moe_export.runtime.core.sessions import KeptSequence, SessionCache
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams
from moe_export.runtime.tokenizer import IncrementalDecoder


def future_token(row: int) -> int:
    """The input token of a planned-ahead decode row: row `row` of the step in flight's sampled ids (negative, so
    never a token id; filled in by the worker before the step runs)."""
    return -1 - row


@dataclass
class Request:
    """One generation request at token level. `budget`: a ReasoningBudget (observe / forced_token /
    reasoning_tokens) or None."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    budget: object | None = None
    images: list = field(default_factory=list)  # runtime.images.PreparedImage of each `<|media_pad|>` run, in order


@dataclass
class SequenceUpdate:
    """What one step produced for one request: new token ids (with logprobs when asked), and the end."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_text_index: int | None = None  # where a stop string starts in the decoded output text
    error: str | None = None  # why a request was aborted by the runtime (e.g. a failing logits processor)
    cached_tokens: int = 0  # prompt tokens whose state came from a kept session or the prefix cache
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) of the most likely
    # the output stage's text (the scheduler detokenizes once, for stop strings and output alike; with a
    # text_decoder): the decoded text of token_ids, a stop token left out, at the end the decoder's held rest
    text: str = ""
    text_complete: bool = True  # the output's text so far ends on a whole character (nothing held)


@dataclass
class _Flight:
    """A started step: the updates it carries (abort notices), what it runs, and its result or future."""

    updates: list[SequenceUpdate]
    scheduled: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    saves: list = field(default_factory=list)
    out: SampledTokens | None = None
    future: Future | None = None


@dataclass
class Sequence:
    request: Request
    tokens: list[int]  # prompt + output
    prompt_len: int
    seed: int  # the request's seed, or a random one drawn at admission
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens fed to the engine by the steps planned so far (positions [0, num_computed))
    pending: int = 0  # tokens being chosen by started steps, not yet in `tokens` (0, 1, or 2 while planning ahead)
    future_row: int = -1  # its sampled row in the latest started step (its next input is future_token(future_row))
    cached_tokens: int = 0  # prompt tokens taken from a kept session or the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks (prefix caching)
    named: int = 0  # its blocks [0, named) are named in the prefix cache (or were already: shared)
    targets: list[int] = field(default_factory=list)  # prompt positions whose state is checkpointed, ascending
    text: IncrementalDecoder | None = None  # the output's text, a step at a time (with a text_decoder)
    text_len: int = 0  # characters of output text decoded so far
    text_tail: str = ""  # their last characters, as many as a stop string may have begun in
    pad_positions: np.ndarray | None = None  # prompt positions of the image rows (`<|media_pad|>`), in order
    image_embeds: np.ndarray | None = None  # [len(pad_positions), hidden] once the tower has run
    key_prefix: tuple[int, ...] = ()  # the prompt with each image's pads replaced by a key of its content

    def session_key(self, n: int) -> tuple[int, ...]:
        """The first n tokens as a session key: an image's `<|media_pad|>` rows stand for its content hash, so a
        kept session is reused only by a prompt with the same images."""
        k = len(self.key_prefix)
        return self.key_prefix[:n] + tuple(self.tokens[k:n]) if k else tuple(self.tokens[:n])

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Scheduler:
    """Continuous batching on rank 0 of `engine` (an Engine, or anything with the same step interface).

    eos_token_ids: the model's stop ids (ignored per request with `ignore_eos`). text_decoder: makes an
    `IncrementalDecoder` (output ids -> text, a step at a time): each output is detokenized once, here, for its
    stop strings and its `SequenceUpdate.text` alike. keep_sessions: keep finished sequences' state for reuse.
    prefix_caching: share cached prefixes across requests (`core.prefix_cache`; off when the runner has no
    checkpoint pool). sample_vocab: sample among ids below it only (the tokenizer's size when the model's
    vocabulary has padding rows)."""

    supports_overlap = True  # a dp-layout group (`core.wide_ep`) runs its idle steps itself: no overlap

    def __init__(self, engine, *, eos_token_ids=(), text_decoder=None, keep_sessions: bool = True,
                 prefix_caching: bool = True, sample_vocab: int | None = None, overlap: bool = False) -> None:
        self.engine = engine
        # overlap: model steps (and, multi-rank, their broadcasts) run in one worker thread, in order; `step()`
        # returns with the next step already started (see the module doc)
        self.overlap = overlap and self.supports_overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe-export-step") if self.overlap else None
        self._flight: _Flight | None = None
        self._last_ids: np.ndarray | None = None  # the worker's latest sampled ids (fills future tokens)
        self.planned_ahead = 0  # steps planned while the previous one ran (overlap)
        self.sample_vocab = sample_vocab
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text_decoder = text_decoder
        self.keep_sessions = keep_sessions
        self.allocator = BlockAllocator(engine.num_blocks, engine.block_size)
        self.sessions = SessionCache()
        slots = getattr(engine, "num_checkpoints", 0)
        self.prefix = PrefixCache(self.allocator, slots, engine.checkpoint_interval) if prefix_caching and slots else None
        self.free_slots = list(range(engine.num_slots - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids: set[str] = set()
        self._aborted: list[SequenceUpdate] = []

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; InputError if it can never run (empty or too long prompt, unknown ids, duplicate id)."""
        self.waiting.append(self.check(request))
        self._ids.add(request.request_id)

    def check(self, request: Request) -> Sequence:
        """The sequence of a request this scheduler could run (not queued); InputError if it can never run."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InputError(f"request {request.request_id}: the prompt must contain at least one token")
        limit = self.engine.max_seq_len
        if n >= limit:
            raise InputError(
                f"request {request.request_id}: the prompt has {n} tokens; the engine's max_seq_len is {limit} "
                f"(at most {limit - 1} prompt tokens, leaving room for one generated token)"
            )
        vocab = self.vocab_size
        if vocab is not None:
            bad = [t for t in request.prompt_ids if not 0 <= int(t) < vocab]
            if bad:
                raise InputError(f"request {request.request_id}: token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if request.sampling.stop and self.text_decoder is None:
            raise InputError(f"request {request.request_id}: stop strings need a tokenizer")
        if request.request_id in self._ids:
            raise InputError(f"request id {request.request_id!r} is already in use")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(62)
        seq = Sequence(request, [int(t) for t in request.prompt_ids], n, seed)
        if request.images:
            self._check_images(seq)
        if self.text_decoder is not None:
            seq.text = self.text_decoder()
        if self._blocks_for(seq) > self.allocator.num_blocks:
            raise InputError(f"request {request.request_id}: prompt + max_tokens needs {self._blocks_for(seq)} cache blocks; "
                             f"the engine has {self.allocator.num_blocks}")
        return seq

    def _check_images(self, seq: Sequence) -> None:
        """An image request: the engine has a tower, and the prompt's `<|media_pad|>` runs match the images."""
        req = seq.request
        if getattr(self.engine, "vision", None) is None:
            raise InputError(f"request {req.request_id}: this engine has no vision tower (text only); "
                             "image input needs a K3 engine built with its vision_config")
        ids = np.asarray(seq.tokens)
        pads = np.flatnonzero(ids == self.engine.media_pad_id)
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
        one packed call)."""
        pending = [s for s in self.waiting if s.request.images and s.image_embeds is None]
        if not pending:
            return
        vision = self.engine.vision
        images = [im for s in pending for im in s.request.images]
        found, missing = vision.lookup(images)
        if missing:
            plan = {"vision": [[im.pixel_values, list(im.plan.grid)] for im in missing]}
            out = self._pool.submit(self._execute, plan).result() if self._pool is not None else self._execute(plan)
            for im, emb in zip(missing, out):
                found[im.digest] = emb
                vision.store(im.digest, emb)
        for s in pending:
            s.image_embeds = np.concatenate([found[im.digest] for im in s.request.images])

    @property
    def vocab_size(self) -> int | None:
        cfg = getattr(self.engine, "model_config", None) or {}
        vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
        return int(vocab) if vocab else None

    def abort(self, request_id: str) -> bool:
        """Drop a request now (its slot and blocks freed); reported as finished with reason "abort"."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq, keep=False)
                    self._aborted.append(self._flushed(seq, SequenceUpdate(request_id, [], None, True, "abort")))
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted or self._flight is not None)

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "blocks_used": self.allocator.used_blocks,
            "blocks_total": self.allocator.num_blocks,
            "kept_sessions": len(self.sessions),
            "reuse_hits": self.sessions.hits,
            "reuse_tokens": self.sessions.reused_tokens,
            "prefix_queried_tokens": self.prefix.queried_tokens if self.prefix else 0,
            "prefix_hit_tokens": self.prefix.hit_tokens if self.prefix else 0,
            "prefix_cached_blocks": self.prefix.cached_blocks if self.prefix else 0,
            "prefix_checkpoints": self.prefix.cached_checkpoints if self.prefix else 0,
        }

    # ---- admission ------------------------------------------------------------------------------

    def _blocks_for(self, seq: Sequence) -> int:
        """Blocks covering every position this request may feed (the last sampled token is never fed)."""
        last = min(seq.prompt_len + seq.request.sampling.max_tokens - 1, self.engine.max_seq_len)
        return self.allocator.blocks_needed(last)

    def _release_kept(self, kept: KeptSequence) -> None:
        self.allocator.decref(kept.blocks)
        self.free_slots.append(kept.slot)

    def _unkeep(self, kept: KeptSequence) -> None:
        """Give a taken session back untouched (not used after all)."""
        self.sessions.hits -= 1
        self.sessions.reused_tokens -= len(kept.tokens)
        self.sessions.keep(kept)

    def _make_room(self, blocks: int, slot: bool) -> bool:
        """Free `blocks` cache blocks (and a slot if `slot`): cached prefix blocks held by nobody else first, then
        kept sessions, least recently used first. False when that is not enough (nothing else is evicted)."""
        while True:
            short = blocks - self.allocator.free_blocks
            if short > 0 and self.prefix is not None and self.prefix.evict_blocks(short):
                continue
            if (short > 0 or (slot and not self.free_slots)) and len(self.sessions):
                self._release_kept(self.sessions.evict_lru())
                continue
            return short <= 0 and not (slot and not self.free_slots)

    def _try_admit(self, seq: Sequence, resets: list[int], restores: list[list[int]]) -> bool:
        """Give `seq` a slot and its blocks, resuming from a kept session it extends or a cached prefix, whichever
        is longer (a restored checkpoint goes to `restores`, a fresh slot to `resets`); False: must wait."""
        need = self._blocks_for(seq)
        key = seq.session_key(len(seq.tokens))
        kept = self.sessions.take_longest_prefix(list(key)) if self.keep_sessions else None
        resume, shared, checkpoint, matched = 0, [], None, 0
        if self.prefix is not None:
            seq.hashes = block_hashes(key, self.allocator.block_size)
            resume, shared, checkpoint, matched = self.prefix.match(seq.hashes, len(seq.tokens))
            if resume and kept is not None and len(kept.tokens) >= resume:
                self.allocator.decref(shared)
                resume, shared, checkpoint = 0, [], None
            elif resume and kept is not None:
                self._unkeep(kept)
                kept = None
        have = len(kept.blocks) if kept is not None else len(shared)
        if not self._make_room(need - have, kept is None):
            if kept is not None:
                self._unkeep(kept)
            self.allocator.decref(shared)
            return False
        if kept is not None:
            seq.slot, seq.blocks = kept.slot, kept.blocks
            seq.num_computed = seq.cached_tokens = len(kept.tokens)
            if need > have:
                seq.blocks = seq.blocks + self.allocator.allocate(need - have)
        else:
            seq.slot = self.free_slots.pop()
            seq.blocks = shared + self.allocator.allocate(need - have)
            seq.num_computed = seq.cached_tokens = resume
            if checkpoint is None:
                resets.append(seq.slot)
            else:
                restores.append([checkpoint, seq.slot])
        if self.prefix is not None:
            seq.named = len(shared)
            seq.targets = self.prefix.checkpoint_targets(len(seq.tokens), seq.num_computed, matched)
            self.prefix.queried_tokens += len(seq.tokens)
            self.prefix.hit_tokens += seq.cached_tokens
        return True

    def _release(self, seq: Sequence, keep: bool) -> None:
        """Hand a sequence's slot and blocks back, or keep them as a session keyed by its computed tokens."""
        self._ids.discard(seq.request.request_id)
        if seq.slot < 0:
            return
        if keep and self.keep_sessions and seq.num_computed > 0:
            used = self.allocator.blocks_needed(seq.num_computed)
            self.allocator.decref(seq.blocks[used:])
            replaced = self.sessions.keep(KeptSequence(seq.session_key(seq.num_computed), seq.slot, seq.blocks[:used]))
            if replaced is not None:
                self._release_kept(replaced)
        else:
            self.allocator.decref(seq.blocks)
            self.free_slots.append(seq.slot)
        seq.slot, seq.blocks = -1, []

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

        def pairs(k: int) -> int:
            blocks = max(step_blocks, self.allocator.blocks_needed(seq.num_computed + k))
            return (step_tokens + k) * blocks * self.allocator.block_size

        lo, hi = 0, n  # pairs() grows with k: the largest k in [0, n] within the budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pairs(mid) <= max_pairs else (lo, mid - 1)
        return lo if lo > 0 or step_tokens > 0 else 1

    def _plan(self) -> tuple[list[int], list[list[int]], list[Sequence], list[SequenceChunk], list[SequenceChunk]]:
        """(slots to reset, [checkpoint, slot] restores, scheduled sequences, their chunks, the chunks whose last
        token is a future token)."""
        resets: list[int] = []
        restores: list[list[int]] = []
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
            table = seq.blocks[: self.allocator.blocks_needed(seq.num_computed + n)]
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
               and self._try_admit(self.waiting[0], resets, restores)):
            seq = self.waiting.popleft()
            self.running.append(seq)
            if not add_chunk(seq):
                break
        return resets, restores, scheduled, chunks, futures

    def step(self) -> list[SequenceUpdate]:
        """Run one engine step (if anything is runnable); returns the updates it produced. With overlap the
        step after it is already running when this returns (planned while this one ran where nothing in it
        needed this step's tokens, else planned from them), so processing the updates overlaps it; a request
        aborted meanwhile has its token of that step dropped."""
        flight = self._flight if self._flight is not None else self._start()
        self._flight = None
        if self._can_plan_ahead(flight):
            ahead = self._start()
            if ahead.chunks:
                self._flight = ahead
                self.planned_ahead += 1
            else:  # nothing runnable before the flight's tokens are in: plan again after them
                self._aborted[:0] = ahead.updates
        updates = self._finish(flight)
        if self.overlap and self._flight is None and self.has_work:
            self._flight = self._start()
        return updates

    def _can_plan_ahead(self, flight: _Flight) -> bool:
        """Whether the step after `flight` can be planned before its tokens are known: overlap is on, and no
        sequence sampled in it needs its token to build its next sampling row (grammar bitmask, logits
        processor, output penalties, a reasoning budget that may force the next token)."""
        if not (self.overlap and flight.rows):
            return False
        for n in flight.rows:
            req = flight.scheduled[n].request
            if req.logits_processors or req.sampling.penalized:
                return False
            if req.budget is not None and req.budget.may_force_next():
                return False
        return True

    def _start(self) -> _Flight:
        """Plan one step and start it (in the worker thread with overlap)."""
        updates, self._aborted = self._aborted, []
        self._encode_images()
        resets, restores, scheduled, chunks, futures = self._plan()
        if not chunks:
            if self.waiting and not self.running and not updates:
                raise RuntimeError("the scheduler cannot admit any waiting request although nothing runs")
            return _Flight(updates)
        saves = self._checkpoint_saves(scheduled, chunks)
        rows = []  # the sequences that get a token (the others are mid-prompt)
        for n, (seq, chunk) in enumerate(zip(scheduled, chunks)):
            seq.num_computed += len(chunk.tokens)
            if seq.num_computed >= len(seq.tokens) + seq.pending:
                rows.append(n)
        sampling = self._sampling_batch([scheduled[n] for n in rows], rows) if rows else None
        if self.overlap:  # (without overlap no step is planned before the previous one's tokens are in)
            for j, n in enumerate(rows):
                scheduled[n].pending += 1
                scheduled[n].future_row = j
        plan = {"resets": resets, "restores": restores, "saves": [[s, c] for s, c, _ in saves]}
        if self.engine.comm is not None:  # one process hands the chunks over as they are
            plan["chunks"] = [[c.slot, c.start, c.tokens, c.block_table, c.image_rows, c.image_embeds] for c in chunks]
        flight = _Flight(updates, scheduled, chunks, rows, saves)
        if futures:
            flight.future = self._pool.submit(self._run_ahead, futures, plan, chunks, sampling)
        elif self._pool is not None:
            flight.future = self._pool.submit(self._execute, plan, chunks, sampling)
        else:
            flight.out = self._execute(plan, chunks, sampling)
        return flight

    def _run_ahead(self, futures: list[SequenceChunk], plan: dict, chunks: list[SequenceChunk], sampling):
        """The worker: fill in the future tokens of a planned-ahead step from the previous step's ids (before the
        broadcast: the plan shares the chunks' token lists), then run it."""
        for chunk in futures:
            chunk.tokens[-1] = int(self._last_ids[-1 - chunk.tokens[-1]])
        return self._execute(plan, chunks, sampling)

    def _finish(self, flight: _Flight) -> list[SequenceUpdate]:
        """Wait for a started step and apply its tokens (sequences aborted while it ran are skipped)."""
        if not flight.chunks:
            return flight.updates
        out = flight.future.result() if flight.future is not None else flight.out
        for seq, chunk in zip(flight.scheduled, flight.chunks):
            if seq.slot >= 0 and self.prefix is not None:  # (a released sequence's state is no longer followed)
                self._name_blocks(seq, chunk.start + len(chunk.tokens))
        for _, checkpoint, h in flight.saves:
            self.prefix.add_checkpoint(h, checkpoint)
        for j, n in enumerate(flight.rows):
            if flight.scheduled[n].slot >= 0:
                flight.updates.append(self._take(flight.scheduled[n], out, j))
        return flight.updates

    def _checkpoint_saves(self, scheduled: list[Sequence], chunks: list[SequenceChunk]) -> list[tuple[int, int, bytes]]:
        """(slot, checkpoint id, name) of the sequences whose chunk ends at their next checkpoint target: their
        state is copied out after the step (a boundary already checkpointed is not copied again)."""
        saves = []
        for seq, chunk in zip(scheduled, chunks):
            end = seq.num_computed + len(chunk.tokens)
            if not seq.targets or seq.targets[0] != end:
                continue
            seq.targets.pop(0)
            h = seq.hashes[end // self.allocator.block_size - 1]
            if self.prefix.has_checkpoint(h):
                continue
            checkpoint = self.prefix.take_checkpoint()
            if checkpoint is not None:
                saves.append((seq.slot, checkpoint, h))
        return saves

    def _name_blocks(self, seq: Sequence, computed: int) -> None:
        """Name `seq`'s full blocks below position `computed` (where a finished step brought it) in the prefix
        cache (output blocks too: a later prompt may repeat the answer)."""
        full = computed // self.allocator.block_size
        if full <= seq.named:
            return
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes += block_hashes(seq.session_key(full * self.allocator.block_size), self.allocator.block_size,
                                       len(seq.hashes), parent)
        self.prefix.add_blocks(seq.hashes[seq.named:full], seq.blocks[seq.named:full])
        seq.named = full

    def _sampling_batch(self, seqs: list[Sequence], rows: list[int]) -> SamplingBatch:
        """The runner's per-row tensors for the sequences that get a token this step (rows: their index in
        the step). Grammar processors (with `fill_bitmask`) become rows of one bitmask, other logits
        processors per-row callables, a budget's forced token a forced id."""
        params = [seq.request.sampling for seq in seqs]
        forced = [-1] * len(seqs)
        processors, grammar_rows, grammars = [], [], []
        for j, seq in enumerate(seqs):
            budget = seq.request.budget
            token = budget.forced_token() if budget is not None else None
            if token is not None:
                forced[j] = token
            for proc in seq.request.logits_processors:
                if hasattr(proc, "fill_bitmask"):
                    grammar_rows.append(j)
                    grammars.append((seq, proc))
                else:
                    processors.append((j, lambda logits, proc=proc, seq=seq: proc(seq.output_ids, logits)))
        sb = SamplingBatch(
            rows=torch.tensor(rows, dtype=torch.long),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            seed=torch.tensor([seq.seed for seq in seqs], dtype=torch.long),
            counter=torch.tensor([len(seq.tokens) + seq.pending - seq.prompt_len for seq in seqs], dtype=torch.long),
            forced=torch.tensor(forced, dtype=torch.long),
            logprobs=torch.tensor([p.top_logprobs if p.logprobs else -1 for p in params], dtype=torch.long),
            vocab=self.sample_vocab, processors=processors,
        )
        if grammars:
            width = grammars[0][1].bitmask_width
            bitmask = torch.empty((len(grammars), width), dtype=torch.int32)
            keep = [g for g, (seq, proc) in enumerate(grammars) if proc.fill_bitmask(seq.output_ids, bitmask[g])]
            if keep:
                sb.bitmask = bitmask[keep]
                sb.bitmask_rows = torch.tensor([grammar_rows[g] for g in keep], dtype=torch.long)
        penalized = [j for j, p in enumerate(params) if p.penalized]
        if penalized:
            self._penalties(sb, seqs, params, penalized)
        bias = [(j, t, v) for j, p in enumerate(params) for t, v in p.logit_bias]
        if bias:
            r, t, v = zip(*bias)
            sb.logit_bias = (torch.tensor(r), torch.tensor(t), torch.tensor(v, dtype=torch.float32))
        banned = [(j, t) for j, (seq, p) in enumerate(zip(seqs, params))
                  if len(seq.tokens) + seq.pending - seq.prompt_len < p.min_tokens
                  for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))]
        if banned:
            r, t = zip(*banned)
            sb.banned = (torch.tensor(r), torch.tensor(t))
        return sb

    @staticmethod
    def _penalties(sb: SamplingBatch, seqs: list[Sequence], params: list[SamplingParams], rows: list[int]) -> None:
        """Repetition (prompt and output tokens) and presence / frequency (output token counts) penalties."""
        sb.penalty_rows = torch.tensor(rows)
        sb.repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        sb.presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        sb.frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        seen_r, seen_t, out_r, out_t, out_c = [], [], [], [], []
        for j in rows:
            seq = seqs[j]
            if params[j].repetition_penalty != 1:
                ids = np.unique(np.asarray(seq.tokens, dtype=np.int64))
                seen_r.append(np.full(ids.shape, j)), seen_t.append(ids)
            if params[j].presence_penalty != 0 or params[j].frequency_penalty != 0:
                ids, counts = np.unique(np.asarray(seq.output_ids, dtype=np.int64), return_counts=True)
                out_r.append(np.full(ids.shape, j)), out_t.append(ids), out_c.append(counts)
        if seen_r:
            sb.seen = (torch.from_numpy(np.concatenate(seen_r)), torch.from_numpy(np.concatenate(seen_t)))
        if out_r and sum(len(t) for t in out_t):
            sb.output_counts = (torch.from_numpy(np.concatenate(out_r)), torch.from_numpy(np.concatenate(out_t)),
                                torch.from_numpy(np.concatenate(out_c)).float())

    def _take(self, seq: Sequence, out: SampledTokens, j: int) -> SequenceUpdate:
        """Apply row j of the step's sampled tokens to `seq`: stop checks, budget, the update."""
        req, params = seq.request, seq.request.sampling
        if j in out.errors:  # a failing request-supplied logits processor, or nothing allowed: that request ends
            self.running.remove(seq)
            self._release(seq, keep=False)
            return self._flushed(seq, SequenceUpdate(req.request_id, [], None, True, "abort", error=out.errors[j]))
        token = int(out.ids[j])
        logprob = out.logprobs[j]
        seq.tokens.append(token)
        if seq.pending:
            seq.pending -= 1
        budget = req.budget
        if budget is not None:
            budget.observe(token)
        update = SequenceUpdate(req.request_id, [token], [logprob] if logprob is not None else None,
                                cached_tokens=seq.cached_tokens,
                                top_logprobs=[out.top_logprobs[j]] if params.logprobs else None)
        n_out = len(seq.tokens) - seq.prompt_len
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
        if update.finish_reason is None and (n_out >= params.max_tokens or len(seq.tokens) >= self.engine.max_seq_len):
            update.finish_reason = "length"
        if update.finish_reason is not None:
            update.finished = True
            self.running.remove(seq)
            self._release(seq, keep=True)
            self._flushed(seq, update)
        return update

    @staticmethod
    def _flushed(seq: Sequence, update: SequenceUpdate) -> SequenceUpdate:
        """A finishing update with the decoder's held rest (an unfinished character) appended to its text."""
        if seq.text is not None:
            update.text += seq.text.flush()
            update.text_complete = True
        return update

    # ---- lockstep execution ---------------------------------------------------------------------

    def _execute(self, plan: dict, chunks: list[SequenceChunk] | None = None, sampling: SamplingBatch | None = None):
        """Broadcast `plan` (multi-rank) and run it on this rank (`run_plan`): the step's sampled tokens, or a
        tower call's embeddings."""
        comm = self.engine.comm
        try:
            if comm is not None:
                comm.broadcast(plan)
            out = run_plan(self.engine, plan, chunks, sampling)
            if isinstance(out, SampledTokens):
                self._last_ids = out.ids
            return out
        except BaseException as exc:
            stop_the_world(self.engine, exc)
            raise

    def shutdown(self) -> None:
        """Let a step still running finish (overlap), then tell follower ranks to leave `follow()` (rank 0,
        multi-rank only)."""
        if self._pool is not None:
            self._flight = None
            self._pool.shutdown(wait=True)
        if self.engine.comm is not None:
            self.engine.comm.broadcast(None)


def run_plan(engine, plan: dict, chunks: list[SequenceChunk] | None = None, sampling: SamplingBatch | None = None):
    """Apply a step plan on this rank: reset new sequences' slots, then one runner step choosing the tokens of
    `sampling` (rank 0; None on followers) -> SampledTokens or None; a plan without chunks is an idle step of a
    dp-layout group (see `runtime.core.wide_ep`); a tower call (`Scheduler._encode_images`) -> the images'
    embeddings. `chunks`: the plan's chunks as objects (one process: the plan does not carry them)."""
    if "vision" in plan:
        return engine.encode_images(plan["vision"])
    for slot in plan["resets"]:
        engine.reset_slot(slot)
    for checkpoint, slot in plan.get("restores", ()):
        engine.restore_state(slot, checkpoint)
    if chunks is None:
        chunks = [SequenceChunk(c[0], c[1], list(c[2]), list(c[3]), *c[4:]) for c in plan["chunks"]]
    width = getattr(engine, "image_width", None)
    out = engine.sample(StepBatch.from_sequences(chunks, width) if chunks else None, sampling)
    for slot, checkpoint in plan.get("saves", ()):
        engine.save_state(slot, checkpoint)
    return out


def follow(engine) -> int:
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


def stop_the_world(engine, exc: BaseException) -> None:
    """Multi-rank: report which rank failed and why, then abort every rank (MPI Abort), never hang."""
    comm = getattr(engine, "comm", None)
    if comm is None:
        return
    rank = comm.world.Get_rank()
    print(f"moe-export: rank {rank} of {comm.world.Get_size()} failed, stopping all ranks: "
          f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    time.sleep(1.0)  # let the launcher forward that line before the abort tears its I/O down
    comm.world.Abort(1)

"""What a running sequence holds: a recurrent-state slot and the cache blocks of its positions, shared with the
prefix cache (`core.prefix_cache`: named full blocks and state checkpoints) and kept sessions (`core.sessions`).

A sequence is admitted when a slot and the blocks for its prompt plus `max_tokens` are free (cached prefix
blocks held by nobody else, then kept sessions, then exact-position checkpoints' partial blocks, are evicted,
least recently used first, to make room). It resumes from the longest of a kept session it exactly extends, a
cached prefix up to a block boundary, or one up to an exact-position checkpoint (whose partial block's rows are
copied into a block of its own: `StepPlan.copies`)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_export.runtime.core.blocks import BlockAllocator
from moe_export.runtime.core.prefix_cache import PartialCheckpoint, PrefixCache, block_hashes, partial_name
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.core.sessions import KeptSequence, SessionCache
from moe_export.runtime.core.state_offload import FoundState, StateLoad, StateOffload, StateRead
from moe_export.runtime.engine.batch import SequenceChunk
from moe_export.runtime.engine.runner import ModelRunner


def session_lineage(session: str) -> str:
    """The lineage of the checkpoints of requests naming `session` (`Request.session`; apart from request ids)."""
    return "session:" + session


@dataclass
class CheckpointSave:
    """After a step, `slot`'s state is copied into `checkpoint`, named `name` (the hash of the block it ends, or an
    exact-position one's `partial_name`: `partial` says where it ends, its block reference taken) for `lineage`."""

    slot: int
    checkpoint: int
    name: bytes
    lineage: str = ""
    agent: bool = False  # the sequence resumed from its lineage's state, or names its session: an agent session
    partial: PartialCheckpoint | None = None


class Resources:
    """Slots, cache blocks, the prefix cache (None when off or the runner has no checkpoint pool) and kept
    sessions of one scheduler over `engine`."""

    def __init__(self, engine: ModelRunner, *, keep_sessions: bool, prefix_caching: bool,
                 offload: StateOffload | None = None) -> None:
        self.max_seq_len = engine.max_seq_len
        self.keep_sessions = keep_sessions
        self.allocator = BlockAllocator(engine.num_blocks, engine.block_size)
        self.sessions = SessionCache()
        slots = engine.num_checkpoints
        self.prefix = PrefixCache(self.allocator, slots, engine.checkpoint_interval) if prefix_caching and slots else None
        self.free_slots = list(range(engine.num_slots - 1, -1, -1))
        self.offload = offload if self.prefix is not None else None  # (its entries are named by the prefix cache's)
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks for the step being planned

    def blocks_for(self, seq: Sequence) -> int:
        """Blocks covering every position this request may feed (the last sampled token is never fed)."""
        last = min(seq.prompt_len + seq.request.sampling.max_tokens - 1, self.max_seq_len)
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
            if short > 0 and self.prefix is not None and self.prefix.evict_partial():
                continue
            return short <= 0 and not (slot and not self.free_slots)

    def admit(self, seq: Sequence, resets: list[int], restores: list[tuple[int, int]], warm: bool = False) -> bool:
        """Give `seq` a slot and its blocks, resuming from a kept session it extends or a cached prefix, whichever
        is longer (a restored (checkpoint, slot) goes to `restores`, a fresh slot to `resets`, an exact-position
        checkpoint's partial block copied into the sequence's own to `take_copies`); False: must wait. warm: a warm
        turn, whose prompt does not count in the prefix cache's queried / hit tokens."""
        need = self.blocks_for(seq)
        key = seq.session_key(len(seq.tokens))
        kept = self.sessions.take_longest_prefix(key) if self.keep_sessions else None
        resume, shared, checkpoint, matched, lineage, copy_from = 0, [], None, 0, None, None
        if self.prefix is not None:  # the kept session's block names are reused: only the new blocks are hashed
            bs = self.allocator.block_size
            known = kept.hashes if kept is not None else []
            seq.hashes = known + block_hashes(key, bs, len(known), known[-1] if known else b"")
            resume, shared, checkpoint, matched = self.prefix.match(seq.hashes, len(seq.tokens))
            if resume:
                lineage = self.prefix.lineage(seq.hashes[resume // bs - 1])
            floor = max(resume, len(kept.tokens) if kept is not None else 0)
            found = self.prefix.match_partial(key, seq.hashes, len(seq.tokens), matched, floor)
            if found is not None:  # copy-on-write: its partial block's rows into a block of the sequence's own
                self.allocator.decref(shared)
                resume, shared, checkpoint, copy_from = found.position, found.blocks, found.checkpoint, found.block
                lineage = self.prefix.lineage(found.name)
            if resume and kept is not None and len(kept.tokens) >= resume:  # (never a partial one's: floor)
                self.allocator.decref(shared)
                resume, shared, checkpoint = 0, [], None
            elif resume and kept is not None:
                self._unkeep(kept)
                kept = None
        if self.offload is not None:
            beat = len(kept.tokens) if kept is not None else resume
            found = self.offload.find(seq.hashes, key, len(seq.tokens), beat, self.prefix.cached_block)
            if found is not None:
                if kept is not None:
                    self._unkeep(kept)
                self.allocator.decref(shared)
                return self._admit_offloaded(seq, found, need, matched)
        have = len(kept.blocks) if kept is not None else len(shared)
        if not self._make_room(need - have, kept is None):
            if kept is not None:
                self._unkeep(kept)
            self.allocator.decref(shared)
            return False
        if kept is not None:
            seq.slot, seq.blocks = kept.slot, kept.blocks
            seq.num_computed = seq.cached_tokens = len(kept.tokens)
            seq.lineage = kept.lineage or seq.request_id
            if need > have:
                seq.blocks = seq.blocks + self.allocator.allocate(need - have)
        else:
            seq.slot = self.free_slots.pop()
            seq.blocks = shared + self.allocator.allocate(need - have)
            seq.num_computed = seq.cached_tokens = resume
            if checkpoint is None:
                resets.append(seq.slot)
            else:
                restores.append((checkpoint, seq.slot))
            if copy_from is not None:
                self._copies.append((copy_from, seq.blocks[len(shared)]))
            seq.lineage = lineage if checkpoint is not None and lineage else seq.request_id
        if self.prefix is not None:
            self._follow(seq, resume, matched, warm)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies of the sequences admitted since the last call (`StepPlan.copies`:
        run before the step's chunks, so a source a checkpoint gave up meanwhile is read before anyone writes it)."""
        copies, self._copies = self._copies, []
        return copies

    def _follow(self, seq: Sequence, resume: int, matched: int, warm: bool) -> None:
        """The prefix cache's side of an admitted `seq` resuming at `resume`: its lineage's use, its checkpoint targets
        and, unless a warm turn, its prompt in the queried / hit counters."""
        if seq.num_computed:
            self.prefix.touch_session(seq.lineage)
        if seq.request.session is not None:  # a named session owns its checkpoints from its first request on
            seq.lineage = session_lineage(seq.request.session)
            self.prefix.touch_session(seq.lineage)
        seq.named = resume // self.allocator.block_size
        seq.targets = self.prefix.checkpoint_targets(len(seq.tokens), seq.num_computed, matched,
                                                     seq.request.turn_points)
        if not warm:
            self.prefix.queried_tokens += len(seq.tokens)
            self.prefix.hit_tokens += seq.cached_tokens

    def _admit_offloaded(self, seq: Sequence, found: FoundState, need: int, matched: int) -> bool:
        """Admit `seq` resuming from a state of the offload store: the full blocks the prefix cache holds are
        shared, the others and the tail block are fresh blocks the loads fill (the full ones named again)."""
        names = seq.hashes[:found.blocks]
        present = [self.prefix.cached_block(h) for h in names]
        shared = [b for b in present if b is not None]
        self.allocator.incref(shared)
        if not self._make_room(need - len(shared), True):
            self.allocator.decref(shared)
            return False
        fresh = iter(self.allocator.allocate(need - len(shared)))
        seq.blocks = [b if b is not None else next(fresh) for b in present] + list(fresh)
        seq.slot = self.free_slots.pop()
        self.offload.load(seq.slot, found, seq.blocks)
        loaded = [i for i, b in enumerate(present) if b is None]
        self.prefix.add_blocks([names[i] for i in loaded], [seq.blocks[i] for i in loaded])
        seq.num_computed = seq.cached_tokens = found.position
        session = seq.request.session
        # (the stored state's lineage is not stored: this request starts one, or joins the session it names)
        seq.lineage = session_lineage(session) if session is not None else seq.request_id
        seq.named = found.blocks
        seq.targets = self.prefix.checkpoint_targets(len(seq.tokens), seq.num_computed, max(matched, found.blocks),
                                                     seq.request.turn_points)
        self.prefix.queried_tokens += len(seq.tokens)
        self.prefix.hit_tokens += seq.cached_tokens
        self.offload.loaded_tokens += seq.cached_tokens
        return True

    def release(self, seq: Sequence, keep: bool) -> None:
        """Hand a sequence's slot and blocks back, or keep them as a session keyed by its computed tokens (a copy into
        its blocks not yet in a plan is dropped: it was released in the schedule that admitted it)."""
        if seq.slot < 0:
            return
        if self._copies:
            self._copies = [c for c in self._copies if c[1] not in seq.blocks]
        if keep and self.keep_sessions and seq.num_computed > 0:
            used = self.allocator.blocks_needed(seq.num_computed)
            self.allocator.decref(seq.blocks[used:])
            hashes = seq.hashes[:seq.num_computed // self.allocator.block_size]
            kept = KeptSequence(seq.session_key(seq.num_computed).copy(), seq.slot, seq.blocks[:used], hashes,
                                seq.lineage)
            replaced = self.sessions.keep(kept)
            if replaced is not None:
                self._release_kept(replaced)
            if self.offload is not None:
                full = seq.num_computed // self.allocator.block_size
                if len(hashes) < full:  # (its last block was filled by a step after its last update)
                    hashes = hashes + block_hashes(kept.tokens, self.allocator.block_size, len(hashes),
                                                   hashes[-1] if hashes else b"")
                self.offload.session_kept(kept.tokens, hashes, kept.slot, kept.blocks)
        else:
            self.allocator.decref(seq.blocks)
            self.free_slots.append(seq.slot)
        seq.slot, seq.blocks = -1, []

    def checkpoint_saves(self, scheduled: list[Sequence], chunks: list[SequenceChunk]) -> list[CheckpointSave]:
        """The sequences whose chunk ends at their next checkpoint target: their state is copied out after the
        step (a boundary already checkpointed is not copied again). Call before their `num_computed` advances."""
        if self.prefix is None:
            return []
        saves = []
        for seq, chunk in zip(scheduled, chunks):
            end = seq.num_computed + len(chunk.tokens)
            if not seq.targets or seq.targets[0] != end:
                continue
            seq.targets.pop(0)
            bs = self.allocator.block_size
            full, partial = divmod(end, bs)
            parent = seq.hashes[full - 1] if full else b""
            if partial:
                tail = seq.session_key(end)[full * bs:].copy()
                h = partial_name(parent, tail)
            else:
                h = parent
            if self.prefix.has_checkpoint(h):
                continue
            checkpoint = self.prefix.take_checkpoint(seq.lineage)
            if checkpoint is None:
                continue
            agent = seq.cached_tokens > 0 or seq.request.session is not None
            save = CheckpointSave(seq.slot, checkpoint, h, seq.lineage, agent=agent)
            if partial:  # the block's first rows are the tail's: it stays allocated while the checkpoint lives
                save.partial = PartialCheckpoint(parent, tail, seq.blocks[full])
                self.allocator.incref([save.partial.block])
            saves.append(save)
        return saves

    def commit_saves(self, saves: list[CheckpointSave]) -> None:
        """Name the checkpoints a finished step wrote."""
        for save in saves:
            self.prefix.add_checkpoint(save.name, save.checkpoint, save.lineage, save.partial, save.agent)
            if self.offload is not None:
                self.offload.checkpoint_named(save.name, save.checkpoint, save.partial)

    def drop_saves(self, saves: list[CheckpointSave]) -> None:
        """Give back the checkpoints of a step that failed (their contents are not the states they were to be)."""
        for save in saves:
            self.prefix.free_checkpoint(save.checkpoint)
            if save.partial is not None:
                self.allocator.decref([save.partial.block])

    def name_blocks(self, seq: Sequence, computed: int) -> None:
        """Name `seq`'s full blocks below position `computed` (where a finished step brought it) in the prefix
        cache (output blocks too: a later prompt may repeat the answer)."""
        if self.prefix is None:
            return
        full = computed // self.allocator.block_size
        if full <= seq.named:
            return
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes += block_hashes(seq.session_key(full * self.allocator.block_size), self.allocator.block_size,
                                       len(seq.hashes), parent)  # only the blocks not hashed yet
        self.prefix.add_blocks(seq.hashes[seq.named:full], seq.blocks[seq.named:full])
        if self.offload is not None:
            self.offload.blocks_named(seq.hashes[seq.named:full], seq.blocks[seq.named:full])
        seq.named = full

    def offload_io(self) -> tuple[list[StateRead], list[StateLoad]]:
        """The offload store's reads and loads for the step being planned (`StepPlan.reads` / `loads`)."""
        if self.offload is None:
            return [], []
        return self.offload.take_reads(), self.offload.take_loads()

    def offload_read(self, reads: list[StateRead], rows: list | None) -> None:
        """Hand what a step read to the offload store (rows None: the step failed)."""
        if self.offload is not None and reads:
            self.offload.reads_done(reads, rows)

    def offload_idle(self, read_rows) -> None:
        """No step in flight: read what the offload store still waits for (kept sessions' last states) with
        `read_rows(ReadPlan)` (on every rank)."""
        if self.offload is not None:
            self.offload.read_now(read_rows)

    def close_offload(self) -> None:
        """At shutdown (after `offload_idle`): wait for the offload files."""
        if self.offload is not None:
            self.offload.store.close()

    def stats(self) -> dict:
        return {
            "blocks_used": self.allocator.used_blocks,
            "blocks_total": self.allocator.num_blocks,
            "kept_sessions": len(self.sessions),
            "reuse_hits": self.sessions.hits,
            "reuse_tokens": self.sessions.reused_tokens,
            "prefix_queried_tokens": self.prefix.queried_tokens if self.prefix else 0,
            "prefix_hit_tokens": self.prefix.hit_tokens if self.prefix else 0,
            "prefix_cached_blocks": self.prefix.cached_blocks if self.prefix else 0,
            "prefix_checkpoints": self.prefix.cached_checkpoints if self.prefix else 0,
            "offload_loaded_tokens": self.offload.loaded_tokens if self.offload else 0,
            "offload_files_written": self.offload.store.written if self.offload else 0,
            "offload_files_rejected": self.offload.store.rejected if self.offload else 0,
            "offload_disk_bytes": self.offload.store.disk_used if self.offload else 0,
        }

"""Automatic prefix caching across requests for hybrid models (MLA / indexer cache blocks + recurrent state).

Full-attention cache blocks are shared by content: block i of a sequence is named by a chained hash
h_i = H(h_{i-1}, tokens of block i), so equal names mean equal prefixes [0, (i+1) x block_size). Only full,
computed blocks are named; a sequence never writes into a named block again (it writes from its own
position on, into its own blocks), so a partially filled last block is never shared for writing: a request
that resumes from a cached prefix gets fresh blocks from the resume position on (copy-on-write at the
divergence point, where the copy is the recomputation of the rest). The cache holds one allocator reference
per named block; a block whose only holder is the cache is evictable, least recently used first.

The recurrent state (KDA state, conv windows) cannot be rewound, so it is checkpointed: a copy of a slot's
state rows into a checkpoint pool, taken right after a step whose chunk ended exactly at a block boundary,
and named by that boundary's block hash. A request resumes from the deepest boundary whose blocks are
all cached AND which has a checkpoint, at most its prompt length - 1 (the last prompt token is always fed,
its logits give the first output token): the checkpoint is copied back into the request's slot and only the
rest of the prompt is prefilled. Where checkpoints are taken (`checkpoint_targets`): every `interval`
tokens, the last block boundary of each prompt (repeated prompts, multi-turn continuations), and the
block boundary where a prompt's cached blocks end (the divergence point another request will share). A
checkpoint is referenced by nobody after its copy-back.

Exact-position checkpoints: a chat prompt says where the next turn's prompt may depart from it
(`Request.turn_points`: the end of the conversation before the tool-choice message K3 renders after it, where
the next prompt holds this turn instead; the end of the prompt, where the model's own tokens begin). The state
is checkpointed at exactly those positions (and at the block boundary before each), named by the hash of the full blocks before it and the tokens of its partial block, and the
checkpoint holds a reference on that partial block, whose first positions keep their cache rows. A prompt
continuing those exact tokens resumes there when it can write into the partial block (copy-on-write without a
copy): nobody else holds it but the cache's name and kept sessions, which are then dropped (the partial
checkpoint is consumed once the request is admitted; a request that must wait leaves it named, and a warm turn holds
it until it has checkpointed its own last block boundary, naming it again if it is given up before); otherwise it
resumes at the block boundary before, replaying the few tokens after it.

Eviction is least recently used by session: each checkpoint belongs to a lineage (the session its request names,
`Request.session`: OpenAI's `prompt_cache_key` / `user`, Anthropic's `metadata.user_id`; else the request that wrote
it, or the lineage of the kept session or checkpoint that request resumed from); a named session, from its first
request on, and a lineage resumed from at least once are agent sessions. The pool holds
`limits.checkpoints_per_slot` x the slots (the planner prices it). When the pool is full, the least recently used checkpoint of a one-turn lineage
goes first; only when every checkpoint belongs to an agent session, the least recently used session's oldest;
a lineage never evicts its own checkpoints while others' remain (a new prompt's interval checkpoints stay, for
the requests that will share its prefix).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from moe_export.runtime.core.blocks import BlockAllocator


def block_hashes(key, block_size: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of `key` (a sequence of ints, or an int64 array: the same names) from block
    `start` on (`parent`: the hash of block start-1); the work is that of those blocks alone. Key entries may be
    negative (an image's content stands in for its pad tokens)."""
    out = []
    for i in range(start, len(key) // block_size):
        data = np.asarray(key[i * block_size:(i + 1) * block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


def partial_name(parent: bytes, tail: np.ndarray) -> bytes:
    """Name of an exact-position checkpoint: the hash of the full blocks before it (`parent`, b"" at block 0) and
    the tokens after them (`tail`, [1, block_size) int64)."""
    return hashlib.blake2b(b"partial" + parent + tail.tobytes(), digest_size=16).digest()


@dataclass
class PartialCheckpoint:
    """Where an exact-position checkpoint ends: after the full blocks named `parent` (b"" at block 0), `tail`
    [t] int64 tokens into cache block `block` (one reference held: its first t rows are the tail's)."""

    parent: bytes
    tail: np.ndarray
    block: int


@dataclass
class HeldCheckpoint:
    """An exact-position checkpoint taken out of the cache by a sequence resuming from it (`PrefixCache.hold_partial`):
    its id stays taken and one reference on its partial block stays held, so that it can be named again as it was
    (`restore_held`: the sequence did not resume from it after all, or is a warm turn given up) or given up
    (`release_held`)."""

    name: bytes
    checkpoint: int
    lineage: str
    agent: bool
    partial: PartialCheckpoint


@dataclass
class PartialMatch:
    """A prompt's deepest exact-position checkpoint: resume at `position` with the full blocks `blocks` (a
    reference taken on each: the caller owns them) and the checkpoint `name` / id `checkpoint` (its partial block
    not yet taken: `PrefixCache.hold_partial`)."""

    position: int
    blocks: list[int]
    name: bytes
    checkpoint: int
    block: int


class PrefixCache:
    """Named cache blocks (refcounted through `allocator`) and recurrent-state checkpoints (ids
    0..num_checkpoints-1 of the runner's checkpoint pool), both LRU. Counters: queried_tokens (prompt tokens of
    admitted requests), hit_tokens (of those, tokens not prefilled thanks to the cache)."""

    def __init__(self, allocator: BlockAllocator, num_checkpoints: int, interval: int) -> None:
        if interval < 1 or interval % allocator.block_size:
            raise ValueError(f"checkpoint interval {interval} must be a positive multiple of the block size "
                             f"{allocator.block_size}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.interval = interval
        self.num_checkpoints = num_checkpoints
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._block_names: dict[int, bytes] = {}  # named block -> its name
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # boundary and exact-position ones, LRU first
        self._partials: dict[bytes, PartialCheckpoint] = {}  # exact-position checkpoints by name
        self._partials_after: dict[bytes, set[bytes]] = {}  # parent -> names of the partial checkpoints after it
        self._free_checkpoints = list(range(num_checkpoints - 1, -1, -1))
        self._lineage: dict[bytes, str] = {}  # checkpoint name -> its lineage
        self._lineage_checkpoints: dict[str, int] = {}
        self._sessions: OrderedDict[str, None] = OrderedDict()  # lineages holding checkpoints, LRU first
        self._agents: set[str] = set()  # lineages resumed from at least once
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def cached_checkpoints(self) -> int:
        return len(self._checkpoints)

    def match(self, hashes: list[bytes], prompt_len: int) -> tuple[int, list[int], int | None, int]:
        """The longest resumable cached prefix of a prompt with full-block hashes `hashes`: (resume position,
        its blocks (a reference taken on each: the caller owns them), checkpoint id to restore (None: resume 0),
        blocks cached in a row from the start (>= the resume's: where this prompt diverges from cached ones))."""
        matched = 0
        while matched < len(hashes) and hashes[matched] in self._blocks:
            matched += 1
        k = min(matched, (prompt_len - 1) // self.block_size)
        while k > 0 and hashes[k - 1] not in self._checkpoints:
            k -= 1
        if k == 0:
            return 0, [], None, matched
        blocks = [self._blocks[h] for h in hashes[:k]]
        for h in reversed(hashes[:k]):  # the prefix's head is the most recently used: tails are evicted first
            self._blocks.move_to_end(h)
        self._checkpoints.move_to_end(hashes[k - 1])
        self.allocator.incref(blocks)
        return k * self.block_size, blocks, self._checkpoints[hashes[k - 1]], matched

    def match_partial(self, key: np.ndarray, hashes: list[bytes], prompt_len: int, matched: int,
                      floor: int) -> PartialMatch | None:
        """The deepest exact-position checkpoint of a prompt (`key` [n] int64, its full-block `hashes`, `matched` of
        them cached in a row) beyond position `floor`, at most prompt_len - 1; None if there is none."""
        bs = self.block_size
        for k in range(min(matched, (prompt_len - 1) // bs), floor // bs - 1, -1):
            best = None
            for name in self._partials_after.get(hashes[k - 1] if k else b"", ()):
                part = self._partials[name]
                end = k * bs + len(part.tail)
                if floor < end < prompt_len and (best is None or end > best[0]) \
                        and np.array_equal(key[k * bs:end], part.tail):
                    best = (end, name)
            if best is not None:
                end, name = best
                blocks = [self._blocks[h] for h in hashes[:k]]
                for h in reversed(hashes[:k]):
                    self._blocks.move_to_end(h)
                self.allocator.incref(blocks)
                return PartialMatch(end, blocks, name, self._checkpoints[name], self._partials[name].block)
        return None

    def named(self, block: int) -> bool:
        return block in self._block_names

    def unname(self, block: int) -> None:
        """Forget a named block's name (its reference released): its content is about to change."""
        del self._blocks[self._block_names.pop(block)]
        self.allocator.decref([block])

    def partials_on(self, block: int) -> list[bytes]:
        """Names of the exact-position checkpoints holding `block`."""
        return [name for name, part in self._partials.items() if part.block == block]

    def drop_checkpoint(self, name: bytes) -> None:
        """Forget a checkpoint (an exact-position one's block reference released)."""
        self._forget_checkpoint(name, release_block=True)

    def hold_partial(self, name: bytes) -> HeldCheckpoint:
        """Take out an exact-position checkpoint whose state a sequence is to restore and whose partial block it is
        to write into (from the checkpoint's first position on: its tail's rows stay as they are). It is no longer
        found, but its id and block reference are held (`HeldCheckpoint`) until `release_held` or `restore_held`."""
        lineage, checkpoint = self._lineage[name], self._checkpoints[name]
        agent = lineage in self._agents
        part = self._forget_checkpoint(name, release_block=False, free_id=False)
        return HeldCheckpoint(name, checkpoint, lineage, agent, part)

    def release_held(self, held: HeldCheckpoint) -> None:
        """Give up a held checkpoint: its id is free again (a restore runs before any save of the same step), its
        block reference released."""
        self._free_checkpoints.append(held.checkpoint)
        self.allocator.decref([held.partial.block])

    def restore_held(self, held: HeldCheckpoint) -> None:
        """Name a held checkpoint again, for its lineage, the most recently used (its block reference passes back to
        the cache). Valid while nobody wrote its checkpoint id or its partial block's rows before its position."""
        self.add_checkpoint(held.name, held.checkpoint, held.lineage, held.partial, held.agent)

    def checkpoint_targets(self, prompt_len: int, resume: int, matched_blocks: int,
                           turn_points: tuple[int, ...] = ()) -> list[int]:
        """Positions in (resume, prompt_len] where a sequence's state is checkpointed, ascending: block boundaries
        every `interval` tokens, the divergence point of its cached blocks, its prompt's last block boundary; and
        each of `turn_points` exactly (where a next turn may depart) with the block boundary before it."""
        last = (prompt_len - 1) // self.block_size * self.block_size
        targets = set(range(self.interval, last + 1, self.interval)) | {last, matched_blocks * self.block_size}
        points = {p for p in turn_points if 0 < p <= prompt_len}
        targets |= points | {p // self.block_size * self.block_size for p in points}
        return sorted(t for t in targets if resume < t and (t <= last or t in points))

    def add_blocks(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Name computed full blocks (a reference taken on each newly named one); a hash already named keeps
        its block (the caller's copy stays private to it)."""
        for h, b in zip(hashes, blocks):
            if h in self._blocks:
                continue
            self.allocator.incref([b])
            self._blocks[h] = b
            self._block_names[b] = h

    def cached_block(self, h: bytes) -> int | None:
        """The block named `h`, if cached (no reference taken, its LRU place unchanged)."""
        return self._blocks.get(h)

    def has_checkpoint(self, h: bytes) -> bool:
        return h in self._checkpoints

    def lineage(self, h: bytes) -> str | None:
        """The lineage of checkpoint `h` (None: no such checkpoint)."""
        return self._lineage.get(h)

    def touch_session(self, lineage: str) -> None:
        """A request resumed from `lineage`'s state: an agent session, now the most recently used."""
        if lineage in self._sessions:
            self._agents.add(lineage)
            self._sessions.move_to_end(lineage)

    def take_checkpoint(self, writer: str = "") -> int | None:
        """A checkpoint id for lineage `writer` to write (a free one, else the evicted one's: see the module doc);
        None when the pool has none."""
        if self._free_checkpoints:
            return self._free_checkpoints.pop()
        if not self._checkpoints:
            return None
        others = [(i, h) for i, h in enumerate(self._checkpoints) if self._lineage[h] != writer]
        victim = next((h for _, h in others if self._lineage[h] not in self._agents), None)
        if victim is None and others:  # agent sessions only: the least recently used session's oldest checkpoint
            rank = {lineage: i for i, lineage in enumerate(self._sessions)}
            victim = min(others, key=lambda e: (rank[self._lineage[e[1]]], e[0]))[1]
        if victim is None:  # the writer's own: its oldest
            victim = next(iter(self._checkpoints))
        self._forget_checkpoint(victim, release_block=True)
        return self._free_checkpoints.pop()

    def _forget_checkpoint(self, h: bytes, release_block: bool, free_id: bool = True) -> PartialCheckpoint | None:
        """Drop checkpoint `h` (its id back to the free list if `free_id`, an exact-position one's block reference
        released if `release_block`); its partial record, if it had one."""
        checkpoint = self._checkpoints.pop(h)
        if free_id:
            self._free_checkpoints.append(checkpoint)
        lineage = self._lineage.pop(h)
        self._lineage_checkpoints[lineage] -= 1
        if not self._lineage_checkpoints[lineage]:
            del self._lineage_checkpoints[lineage], self._sessions[lineage]
            self._agents.discard(lineage)
        part = self._partials.pop(h, None)
        if part is not None:
            after = self._partials_after[part.parent]
            after.discard(h)
            if not after:
                del self._partials_after[part.parent]
            if release_block:
                self.allocator.decref([part.block])
        return part

    def free_checkpoint(self, checkpoint: int) -> None:
        """Give back a taken checkpoint id unnamed (the step that was to write it failed)."""
        self._free_checkpoints.append(checkpoint)

    def add_checkpoint(self, h: bytes, checkpoint: int, lineage: str = "", partial: PartialCheckpoint | None = None,
                       agent: bool = False) -> None:
        """Name a written checkpoint: by the hash of the block its state ends, or an exact-position one by
        `partial_name` (`partial`: where it ends; its block reference passes to the cache) of `lineage` (an agent
        session if `agent`) (a name already taken: the id goes back to the free list, the block reference is
        released)."""
        if h in self._checkpoints:
            self._free_checkpoints.append(checkpoint)
            if partial is not None:
                self.allocator.decref([partial.block])
            return
        self._checkpoints[h] = checkpoint
        self._lineage[h] = lineage
        self._lineage_checkpoints[lineage] = self._lineage_checkpoints.get(lineage, 0) + 1
        self._sessions[lineage] = None
        self._sessions.move_to_end(lineage)
        if agent:
            self._agents.add(lineage)
        if partial is not None:
            self._partials[h] = partial
            self._partials_after.setdefault(partial.parent, set()).add(h)

    def evict_partial(self) -> bool:
        """Drop the least recently used exact-position checkpoint, releasing its block; False if there is none."""
        victim = next((h for h in self._checkpoints if h in self._partials), None)
        if victim is None:
            return False
        self._forget_checkpoint(victim, release_block=True)
        return True

    def evict_blocks(self, n: int) -> int:
        """Forget up to n least recently used named blocks held by the cache alone (freeing them); how many."""
        freed = 0
        for h in list(self._blocks):
            if freed >= n:
                break
            b = self._blocks[h]
            if self.allocator.refcount(b) == 1:
                del self._blocks[h], self._block_names[b]
                self.allocator.decref([b])
                freed += 1
        return freed

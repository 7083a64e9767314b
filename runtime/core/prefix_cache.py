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
tokens, the last block boundary of each prompt (repeated prompts, multi-turn continuations) unless its end is a
turn point (below), and the block boundary where a prompt's cached blocks end (the divergence point another
request will share). A checkpoint is referenced by nobody after its copy-back.

Exact-position checkpoints: a chat prompt says where the next turn's prompt may depart from it
(`Request.turn_points`: the end of the conversation before the tool-choice message K3 renders after it, where
the next prompt holds this turn instead; the end of the prompt, where the model's own tokens begin). The state
is checkpointed at exactly those positions (a step ends there: recurrent state is saved only at a step's end; no
step ends at the block boundary before them), named by the hash of the full blocks before it and the tokens of its
partial block, and the checkpoint holds a reference on that partial block, whose first positions keep their cache
rows (a sequence writes only from the position it resumed at on, and the partial block it resumed inside is a
copy of its own or a kept session's it took over, whose end is not before the checkpoint's). A prompt continuing
those exact tokens resumes there with copy-on-write of the partial block: the state is copied back from the
checkpoint and the partial block's rows into a fresh block of the prompt's own (`StepPlan.copies`, run on every
rank before the step's chunks), whoever else holds that block (the sequence that wrote it, still running or kept
as a session, other requests resuming from the same checkpoint, a warm turn). The checkpoint is not consumed: any
number of requests, at once or later, resume from it. A prompt whose end is a turn point gets no checkpoint at its
last block boundary either (the one at its end serves the next turn; a repeat of the same prompt resumes at its
deepest earlier checkpoint).

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
class PartialMatch:
    """A prompt's deepest exact-position checkpoint: resume at `position` with the full blocks `blocks` (a
    reference taken on each: the caller owns them), the checkpoint `name` / id `checkpoint` restored and the rows of
    its partial block `block` copied into a block of the caller's own (no reference taken on it: the copy runs at
    the start of the next step, `StepPlan.copies`, before any step can write the block, even one the checkpoint gave
    up meanwhile)."""

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
                self._checkpoints.move_to_end(name)
                return PartialMatch(end, blocks, name, self._checkpoints[name], self._partials[name].block)
        return None

    def checkpoint_targets(self, prompt_len: int, resume: int, matched_blocks: int,
                           turn_points: tuple[int, ...] = ()) -> list[int]:
        """Positions in (resume, prompt_len] where a sequence's state is checkpointed, ascending: block boundaries
        every `interval` tokens, the divergence point of its cached blocks, each of `turn_points` exactly (where a next
        turn may depart; resumed with copy-on-write of its partial block, so no block boundary before it is added),
        and its prompt's last block boundary unless the prompt's end is a turn point."""
        last = (prompt_len - 1) // self.block_size * self.block_size
        points = {p for p in turn_points if 0 < p <= prompt_len}
        targets = set(range(self.interval, last + 1, self.interval)) | {matched_blocks * self.block_size} | points
        if prompt_len not in points:
            targets.add(last)
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
        self._forget_checkpoint(victim)
        return self._free_checkpoints.pop()

    def _forget_checkpoint(self, h: bytes) -> None:
        """Drop checkpoint `h`: its id back to the free list, an exact-position one's block reference released."""
        checkpoint = self._checkpoints.pop(h)
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
            self.allocator.decref([part.block])

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
        self._forget_checkpoint(victim)
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

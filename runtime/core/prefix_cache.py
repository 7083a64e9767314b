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
checkpoint is referenced by nobody after its copy-back, so checkpoints are evicted least recently used
when the pool is full.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

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
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()
        self._free_checkpoints = list(range(num_checkpoints - 1, -1, -1))
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

    def checkpoint_targets(self, prompt_len: int, resume: int, matched_blocks: int) -> list[int]:
        """Block boundaries in (resume, prompt_len) where a sequence's state is checkpointed, ascending: every
        `interval` tokens, the divergence point of its cached blocks, its prompt's last block boundary."""
        last = (prompt_len - 1) // self.block_size * self.block_size
        targets = set(range(self.interval, last + 1, self.interval)) | {last, matched_blocks * self.block_size}
        return sorted(t for t in targets if resume < t <= last)

    def add_blocks(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Name computed full blocks (a reference taken on each newly named one); a hash already named keeps
        its block (the caller's copy stays private to it)."""
        for h, b in zip(hashes, blocks):
            if h in self._blocks:
                continue
            self.allocator.incref([b])
            self._blocks[h] = b

    def cached_block(self, h: bytes) -> int | None:
        """The block named `h`, if cached (no reference taken, its LRU place unchanged)."""
        return self._blocks.get(h)

    def has_checkpoint(self, h: bytes) -> bool:
        return h in self._checkpoints

    def take_checkpoint(self) -> int | None:
        """A checkpoint id to write (a free one, else the least recently used one's, forgotten); None when the
        pool has none."""
        if self._free_checkpoints:
            return self._free_checkpoints.pop()
        if not self._checkpoints:
            return None
        return self._checkpoints.popitem(last=False)[1]

    def free_checkpoint(self, checkpoint: int) -> None:
        """Give back a taken checkpoint id unnamed (the step that was to write it failed)."""
        self._free_checkpoints.append(checkpoint)

    def add_checkpoint(self, h: bytes, checkpoint: int) -> None:
        """Name a written checkpoint by the hash of the block its state ends (a name already taken: the id goes
        back to the free list)."""
        if h in self._checkpoints:
            self._free_checkpoints.append(checkpoint)
            return
        self._checkpoints[h] = checkpoint

    def evict_blocks(self, n: int) -> int:
        """Forget up to n least recently used named blocks held by the cache alone (freeing them); how many."""
        freed = 0
        for h in list(self._blocks):
            if freed >= n:
                break
            b = self._blocks[h]
            if self.allocator.refcount(b) == 1:
                del self._blocks[h]
                self.allocator.decref([b])
                freed += 1
        return freed

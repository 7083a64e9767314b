"""Cache block allocator: a refcounted pool of fixed-size blocks of token positions.

A sequence's MLA latent / indexer cache lives in blocks of `block_size` positions, listed in its block
table. Blocks may be shared (a kept session and the request that continues it); a block returns to
the free list when its last holder lets it go. Running out is an admission decision of the
scheduler (`PoolExhausted` before anything changes), never a partial allocation.
"""

from __future__ import annotations


class PoolExhausted(Exception):
    """Not enough free blocks for an allocation; nothing was allocated."""


class BlockAllocator:
    """Free list + refcounts over block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering positions [0, num_tokens)."""
        return -(-max(num_tokens, 0) // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks at refcount 1; PoolExhausted (nothing taken) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise PoolExhausted(f"{n} cache blocks requested, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        """One more holder for each (allocated) block."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is free: it cannot gain a holder")
        for b in blocks:
            self._refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """One holder fewer for each block; a block at refcount 0 is free again."""
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if self._refs[b] < n:
                raise ValueError(f"block {b} has {self._refs[b]} holder(s), {n} release(s) asked")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

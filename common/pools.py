"""Pool-size arithmetic shared by the planner (which sizes the pools) and the runners (which allocate them).

A rank's pools: `num_slots` recurrent-state slots (one per concurrent sequence: KDA state and conv windows of
every KDA layer), `num_blocks` cache blocks of `block_size` tokens in each paged pool (MLA latent and DSA
indexer key rows of every MLA layer) and `num_checkpoints` copies of one slot's state for the prefix cache
(`limits.checkpoints_per_slot` x the slots; host memory: pinned beside a GPU, or the very memory the pools take on a
CPU target, where each checkpoint is paid from the pools' budget). The build records what each rank's pools may
take (`EngineMemory`, in config.json); a runner derives its pool sizes from that record for the slots and
checkpoints it runs, with `pool_sizes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moe_export.common.errors import InputError

GIB = 2**30


@dataclass(frozen=True)
class PoolSizes:
    """State pools of one rank: `num_slots` recurrent-state slots and `num_blocks` cache blocks per pool."""

    block_size: int  # tokens per cache block
    num_slots: int
    num_blocks: int
    bytes_per_slot: int  # recurrent state of one sequence (all KDA layers of the rank)
    bytes_per_token: int  # cache of one token (all MLA / indexer pools of the rank)
    num_checkpoints: int = 0  # prefix-cache copies of one slot's state (limits.checkpoints_per_slot x num_slots)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def cache_tokens(self) -> int:
        """Tokens of cache the pools hold (all sequences together)."""
        return self.num_blocks * self.block_size

    @property
    def checkpoint_host_bytes(self) -> int:
        """The prefix cache's recurrent-state checkpoints (`num_checkpoints` x one slot's state), kept in host memory
        (pinned beside a GPU for the runners' asynchronous copies), never on the GPU."""
        return self.num_checkpoints * self.bytes_per_slot

    def sequences_that_fit(self, length: int) -> int:
        """Sequences of `length` tokens the pools hold at once (blocks, and one slot each)."""
        blocks = -(-length // self.block_size)
        return min(self.num_slots, self.num_blocks // blocks) if blocks else self.num_slots


def pool_sizes(free_bytes: int, *, block_size: int, num_slots: int, bytes_per_slot: int, bytes_per_token: int,
               num_checkpoints: int = 0, bytes_per_checkpoint: int = 0) -> PoolSizes:
    """The one pool-size arithmetic: `free_bytes` (memory after weights and workspace) pays for `num_slots`
    recurrent-state slots and `num_checkpoints` state checkpoints of `bytes_per_checkpoint` each (0 where they are
    not in this memory) first; what is left, divided by the bytes of one block, is the cache blocks."""
    left = free_bytes - num_slots * bytes_per_slot - num_checkpoints * bytes_per_checkpoint
    per_block = block_size * bytes_per_token
    num_blocks = max(0, left) // per_block if per_block else 0
    return PoolSizes(block_size, num_slots, int(num_blocks), bytes_per_slot, bytes_per_token, num_checkpoints)


@dataclass(frozen=True)
class PoolBudget:
    """What one rank's pools may take, in bytes: the rank's memory left after its weights, engine memory and the
    reserve (`free_bytes`), one sequence's recurrent state (`bytes_per_slot`), one token's cache rows
    (`bytes_per_token`) and what one prefix-cache state checkpoint takes of `free_bytes` (`bytes_per_checkpoint`:
    one slot's state on a CPU target, whose pools and checkpoints share the host memory; 0 beside a GPU, where the
    checkpoints are pinned host memory)."""

    free_bytes: int
    bytes_per_slot: int
    bytes_per_token: int
    bytes_per_checkpoint: int


@dataclass(frozen=True)
class EngineMemory:
    """config.json's `memory`: each rank's `PoolBudget` and the patches one image may take (K3's vision tower;
    `export.planner.image_patch_limit`)."""

    ranks: tuple[PoolBudget, ...]
    image_patch_limit: int

    def pool_sizes(self, block_size: int, num_slots: int, num_checkpoints: int) -> PoolSizes:
        """The pools every rank allocates for `num_slots` slots and `num_checkpoints` state checkpoints: the smallest
        rank's (ranks run in lockstep on the same block ids)."""
        sizes = [pool_sizes(b.free_bytes, block_size=block_size, num_slots=num_slots, bytes_per_slot=b.bytes_per_slot,
                            bytes_per_token=b.bytes_per_token, num_checkpoints=num_checkpoints,
                            bytes_per_checkpoint=b.bytes_per_checkpoint) for b in self.ranks]
        return min(sizes, key=lambda p: p.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [asdict(b) for b in self.ranks], "image_patch_limit": self.image_patch_limit}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> EngineMemory:
        """Parse config.json's `memory` object; InputError naming the field otherwise."""
        ranks, limit = data.get("ranks"), data.get("image_patch_limit")
        fields = tuple(PoolBudget.__dataclass_fields__)
        if not isinstance(ranks, list) or not all(
                isinstance(r, dict) and sorted(r) == sorted(fields) and all(_is_int(r[f]) for f in fields) for r in ranks):
            raise InputError(f"{source}: field 'memory.ranks' must be a list of {{{', '.join(fields)}}} integer objects "
                             "(an engine built by an earlier moe-export: rebuild it)")
        if not _is_int(limit) or sorted(data) != ["image_patch_limit", "ranks"]:
            raise InputError(f"{source}: field 'memory' must hold 'ranks' and an integer 'image_patch_limit'")
        return cls(tuple(PoolBudget(**r) for r in ranks), limit)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

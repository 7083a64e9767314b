"""BlockAllocator: refcounts, never a partial allocation, exhaustion leaves the pool unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_export.runtime.core.blocks import BlockAllocator, PoolExhausted


def test_allocate_free_and_refcounts():
    pool = BlockAllocator(num_blocks=6, block_size=4)
    assert pool.blocks_needed(0) == 0 and pool.blocks_needed(4) == 1 and pool.blocks_needed(5) == 2
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.free_blocks == 2 and pool.used_blocks == 4
    with pytest.raises(PoolExhausted, match="3 cache blocks requested, 2 of 6 free"):
        pool.allocate(3)
    assert pool.free_blocks == 2  # nothing taken
    pool.incref(a[:2])
    pool.decref(a)
    assert pool.free_blocks == 4 and [pool.refcount(b) for b in a] == [1, 1, 0, 0]
    pool.decref(a[:2])
    assert pool.free_blocks == 6
    with pytest.raises(ValueError, match="holder"):
        pool.decref([a[0]])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([a[0]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 5)), max_size=40))
def test_random_operations_keep_the_pool_consistent(ops):
    """Against a plain dict model of holders: free + used == total, no block handed out twice."""
    pool = BlockAllocator(num_blocks=8, block_size=2)
    holders: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            if n > pool.free_blocks:
                with pytest.raises(PoolExhausted):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                assert not {b for h in holders for b in h} & set(got)
                holders.append(got)
        elif op == "share" and holders:
            h = holders[n % len(holders)]
            pool.incref(h)
            holders.append(list(h))
        elif op == "release" and holders:
            pool.decref(holders.pop(n % len(holders)))
        held = {b for h in holders for b in h}
        assert pool.used_blocks == len(held) and pool.free_blocks + pool.used_blocks == 8

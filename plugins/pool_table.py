"""The pool table: how the pool plugins reach the runner's cache and state pools by address.

TensorRT graphs take no pool as a network input or output (contract ALIASED_PLUGIN_IO_MAY_COPY: TensorRT "may
insert copies" for an aliased plugin output, which would copy every pool every step). As TensorRT-LLM passes
its attention plugin the KV pools' addresses (`host_kv_cache_pool_pointers`) plus per-sequence block offsets
(`kv_cache_block_offsets`), and its recurrent layers their state pools' addresses with a slot mapping, the
runner owns one allocation per pool and passes one small input, the pool table `pool_table` [P, 3] int64: row p
holds pool p's device address, its capacity (slots of a recurrent-state pool, blocks of a paged cache) and a
check word (address ^ capacity ^ `CHECK`). A pool plugin names its row with the attribute `pool` and reaches its
rows through the step's `slot_ids` / `block_tables` (the offsets). The table does not change while the runner
lives (the pools never move), so decode CUDA graphs replay with it.

Two guards, because TensorRT runs plugins on garbage while it times tactics and a wrong address is a silent
memory corruption:
  - on the device (`pool_entry`, every kernel): a row that is not a plausible table row (null or misaligned
    address, capacity < 1, check word wrong) touches no pool memory; indices are clamped to the capacity;
  - on the host, before anything is launched with a table (`check_pool_table`, `check_pool_offsets`: the
    runner when it builds the table and before each step, the launch wrappers of the kernels): a clear
    `PoolTableError` for a null or misaligned address, a wrong check word, or a slot / block beyond the pool.
The ONNX Runtime backend keeps pools as graph inputs (its graphs return the step's new rows and states and the
runtime writes them), so this table exists only in TensorRT graphs.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import triton
import triton.language as tl

COLUMNS = 3  # address, capacity, check word
CHECK = 0x6D6F65706F6F6C73  # "moepools"
ALIGNMENT = 16  # bytes; CUDA allocations are 256-byte aligned, torch's CPU ones 64
_CHECK = tl.constexpr(CHECK)


class PoolTableError(ValueError):
    """A pool table or a step's offsets that would make a pool plugin touch memory outside its pool."""


def table_row(address: int, capacity: int) -> list[int]:
    """One table row: [address, capacity, check word]."""
    return [int(address), int(capacity), int(address) ^ int(capacity) ^ CHECK]


def pool_table(pools: list[torch.Tensor]) -> np.ndarray:
    """[P, 3] int64 host table of `pools` (row p: pools[p]'s address, its first dimension, the check word),
    checked (`check_pool_table`)."""
    table = np.array([table_row(p.data_ptr(), p.shape[0]) for p in pools], dtype=np.int64).reshape(-1, COLUMNS)
    check_pool_table(table)
    return table


_TABLES: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def device_pool_table(pools: list[torch.Tensor]) -> torch.Tensor:
    """`pool_table(pools)` as an int64 tensor on the pools' device, remembered with its pools while it lives
    (`pools_of_table`)."""
    table = torch.from_numpy(pool_table(pools)).to(pools[0].device)
    table.pools = list(pools)
    _TABLES[table.data_ptr()] = table
    return table


def pools_of_table(table: torch.Tensor) -> list[torch.Tensor] | None:
    """The pool tensors of a live table made by `device_pool_table` in this process (the same device memory as
    `table`), or None: for plugin callbacks whose kernels take pool tensors, not addresses (fla's KDA)."""
    made = _TABLES.get(table.data_ptr())
    return made.pools if made is not None and made.shape == table.shape else None


def check_pool_table(table) -> None:
    """PoolTableError unless every row of a host table [P, 3] is a non-null, aligned address with a capacity of
    at least 1 and the right check word."""
    table = np.asarray(table)
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != COLUMNS:
        raise PoolTableError(f"pool table: expected int64 [P, {COLUMNS}], got {table.dtype} {list(table.shape)}")
    for p, (address, capacity, check) in enumerate(table.tolist()):
        if address == 0:
            raise PoolTableError(f"pool table row {p}: null pool address")
        if address % ALIGNMENT:
            raise PoolTableError(f"pool table row {p}: pool address {address:#x} is not {ALIGNMENT}-byte aligned")
        if capacity < 1:
            raise PoolTableError(f"pool table row {p}: capacity {capacity} (a pool has at least one slot or block)")
        if check != address ^ capacity ^ CHECK:
            raise PoolTableError(f"pool table row {p}: check word {check:#x} does not match address and capacity "
                                 "(not a table made by pool_table)")


def check_pool_offsets(table, index: int, *, slot_ids=None, block_tables=None) -> None:
    """PoolTableError when row `index` is not in the host `table`, or a slot id (recurrent-state pools) or a
    block-table entry (paged caches; -1 = unused) lies outside that pool's capacity."""
    table = np.asarray(table)
    if not 0 <= index < table.shape[0]:
        raise PoolTableError(f"pool {index}: the pool table has {table.shape[0]} rows")
    capacity = int(table[index, 1])
    if slot_ids is not None and len(slot_ids):
        slots = np.asarray(slot_ids)
        if slots.min() < 0 or slots.max() >= capacity:
            raise PoolTableError(f"pool {index}: slot ids {slots.min()}..{slots.max()} outside its {capacity} slots")
    if block_tables is not None and np.asarray(block_tables).size:
        blocks = np.asarray(block_tables)
        if blocks.min() < -1 or blocks.max() >= capacity:
            raise PoolTableError(f"pool {index}: block ids {blocks.min()}..{blocks.max()} outside its {capacity} "
                                 "blocks")


@triton.jit
def pool_entry(table_ptr, index, DTYPE: tl.constexpr):
    """Row `index` of the pool table: (the pool's base pointer to DTYPE, its capacity >= 1, whether the row is
    a valid one: non-null 16-byte aligned address, capacity >= 1, matching check word). Kernels mask every pool
    access with the last value, so a garbage table (TensorRT's tactic timing) touches no memory through it."""
    row = table_ptr + index * 3  # index: a kernel argument (Triton may pass 1 as a constant) or a literal
    address = tl.load(row)
    capacity = tl.load(row + 1)
    check = tl.load(row + 2)
    ok = (address != 0) & ((address & 15) == 0) & (capacity > 0) & ((address ^ capacity ^ _CHECK) == check)
    return address.to(tl.pointer_type(DTYPE)), tl.maximum(capacity, 1), ok


TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                 torch.uint8: tl.uint8}  # fmt: skip
# the recipe's kv_cache (plugin attribute `pool_dtype` of the paged-cache ops) -> the pool's torch dtype
CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}



@triton.jit
def in_pool(mask, ok):
    """`mask` where the table row is valid (`ok` from `pool_entry`), all False otherwise (written with `where`:
    `mask & ok` of a tensor and a scalar predicate gives integers, not a mask, in Triton's interpreter)."""
    return tl.where(ok, mask, False)

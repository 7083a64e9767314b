"""A hierarchical cache of prefix state: recurrent-state rows and cache blocks offloaded from the runner's pools to
host memory and to disk, so a conversation resumed after a restart, or after its device blocks were evicted, loads
its state instead of prefilling it (the design of SGLang's HiCache / LMCache: device pools -> host -> disk, each
tier an LRU within a byte cap; our own code).

What is offloaded (write-through, `StateOffload`): every cache block the prefix cache names (by its chained block
hash, `core.prefix_cache`), every recurrent-state checkpoint it commits (at a block boundary), and every kept
session's state at its exact end (`core.sessions`: the prompt plus the generated turn, a partial last block
included). The runner's rows are read as raw bytes inside a step plan (`StepPlan.reads`, run before anything else
in the plan), so each read is ordered after the steps that wrote those rows and before any step that reuses them;
when the engine core goes idle, what is queued is read at once (`StateOffload.read_now`: no step is in flight), so an
idle server's last turn reaches disk without waiting for a next request or a shutdown.

What is loaded: at admission, a prompt whose longest resumable prefix is deeper in the offload store than on the
device (kept session or prefix cache) gets fresh blocks for the missing ones and its slot's recurrent state from the
store (`StepPlan.loads`, written before the step's chunks run); the loaded full blocks are named in the prefix cache
again.

An entry is one safetensors file (`core.offload_store`: raw uint8 rows, never pickle) in the store's directory, written to a temporary
name and renamed. Its header carries the engine identity (a hash of the runner class, the pool layout and the
engine's manifest.json, the sha256 of every file: another engine, model, dtype or layout is another identity), what
the entry is
(a block's chained hash, or a state's prefix hash and tail tokens: the token prefix it holds) and a hash of all of
that and its contents. A file that does not parse, is truncated, names another identity or entry, or whose
contents do not hash to its header is never loaded (ours are deleted; another identity's are left alone).

Costs: a step that reads copies its rows to the host before it runs (on a GPU runner a wait for its stream: the
write-through is synchronous, not on a copy stream of its own as HiCache's); hashing and files are the writer
thread's. At admission the lookup walks the prompt's block names (dictionary lookups, no hashing).

Under mpiexec (the tp layout; not the dp layout) every rank holds its own shards of the pools, so every rank keeps
its own store, `rank{N}/` in the directory (its identity is its own layout: `{rank}/{pool}` keys). Rank 0's
scheduler decides; the followers get the same work through the plans rank 0 broadcasts (`core.execution`): a step's
`reads` and an idle `ReadPlan` are read and stored on every rank, and before a load every rank checks its own copy
of what rank 0 found (`AgreePlan`: the load happens only if all ranks hold a valid copy, else the request prefills).
The agreed rows stay on each rank under the plan's ticket until the step's `StateLoad` names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_export.runtime.core.offload_store import STATE_PREFIX, TAIL_PREFIX, OffloadStore, engine_identity
from moe_export.runtime.core.prefix_cache import PartialCheckpoint


@dataclass
class StateRead:
    """Rows to read out of the runner at the start of a step: `blocks` (with their chained hashes `names`), or the
    recurrent state of `slot` or of `checkpoint` (one of the two; with `tail_block` the block holding the state's
    `tail` tokens), named by `prefix` (the chained hash of the full blocks before it, b"" for none) and `tail`."""

    blocks: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    slot: int | None = None
    checkpoint: int | None = None
    tail_block: int | None = None
    prefix: bytes = b""
    tail: tuple[int, ...] = ()

    @property
    def is_state(self) -> bool:
        return self.slot is not None or self.checkpoint is not None


@dataclass
class StateLoad:
    """Rows to write into the runner before a step's chunks: cache `blocks` [n] (rows: pool key -> the n blocks' rows,
    uint8 [bytes] each, the store's own arrays: the runner writes each into its place) and the recurrent state of
    `slot` (pool key -> uint8 [bytes]). Under mpiexec the rows are each rank's own: the
    load names the `ticket` of the `AgreePlan` that fetched them (state and block_rows are empty)."""

    slot: int
    state: dict[str, np.ndarray]
    blocks: list[int]
    block_rows: dict[str, list[np.ndarray]]
    ticket: int | None = None


@dataclass
class AgreePlan:
    """Rank 0 found a stored state to load (under mpiexec): every rank fetches its own copy of it (the state after
    `prefix` with `tail`, at `position`, after `blocks` full blocks; `missing`: block index -> chained hash of the
    blocks the device does not hold) and keeps it under `ticket` only if every rank's copy is valid."""

    ticket: int
    prefix: bytes
    tail: tuple[int, ...]
    blocks: int
    position: int
    missing: dict[int, bytes]


@dataclass
class ReadPlan:
    """Rows to read on every rank while no step is in flight (the engine core idle or shutting down)."""

    reads: list[StateRead]


def run_read(engine, read: StateRead) -> dict[str, np.ndarray]:
    """A read on this process's runner: block rows (pool key -> [n, bytes]) or state rows (`STATE_PREFIX` + key,
    with `TAIL_PREFIX` + key -> the tail block's rows [bytes])."""
    if not read.is_state:
        return engine.read_blocks(read.blocks)
    rows = engine.read_slot(read.slot) if read.slot is not None else engine.read_checkpoint(read.checkpoint)
    out = {STATE_PREFIX + k: v for k, v in rows.items()}
    if read.tail_block is not None:
        out.update({TAIL_PREFIX + k: v[0] for k, v in engine.read_blocks([read.tail_block]).items()})
    return out


def run_load(engine, load: StateLoad, offload: StateOffload | None = None) -> None:
    """Write a load into this rank's runner (under mpiexec its ticket's rows, from this rank's `offload`)."""
    state, block_rows = (load.state, load.block_rows) if load.ticket is None else offload.claim(load.ticket)
    if load.blocks:
        engine.write_blocks(load.blocks, block_rows)
    engine.write_slot(load.slot, state)


def run_agree(comm, offload: StateOffload, plan: AgreePlan) -> None:
    """Every rank: fetch this rank's copy of `plan`'s state; hold it under the ticket if all ranks have one."""
    from mpi4py import MPI

    found = offload.fetch(plan)
    if comm.world.allreduce(int(found is not None), op=MPI.MIN):
        offload.hold(plan.ticket, found)


@dataclass
class FoundState:
    """A stored state deeper than the device's: `position` tokens (full `blocks` then the tail), its state rows,
    and the rows of the full blocks the device's prefix cache does not hold (block index -> pool key -> [bytes])."""

    blocks: int
    position: int
    state: dict[str, np.ndarray]
    missing: dict[int, dict[str, np.ndarray]]
    ticket: int | None = None  # under mpiexec: the `AgreePlan` under which every rank holds its own copy


def open_state_offload(engine, engine_dir: str | Path, directory: str | Path, *, host_bytes: int,
                       disk_bytes: int) -> StateOffload:
    """The offload store of `engine` (built from `engine_dir`) in `directory` (created if missing; under mpiexec
    this rank's `rank{N}/` in it). InputError when the runner cannot read its rows on the host
    (`runner.OffloadRunner`) or is a dp-layout engine under mpiexec."""
    from moe_export.common.errors import InputError

    if not hasattr(engine, "read_slot"):
        raise InputError(f"{type(engine).__name__} cannot offload its state (no host reads of its rows)")
    if engine.comm is not None and engine.dp_layout:
        raise InputError("state offload is for one-process engines and the tp layout (the dp layout's groups "
                         "schedule their own requests)")
    if engine.comm is not None:
        directory = Path(directory) / f"rank{engine.comm.world.Get_rank()}"
    if disk_bytes < 0 or host_bytes < 0:
        raise InputError(f"offload caps must be >= 0 bytes, got host {host_bytes}, disk {disk_bytes}")
    layout = engine.state_layout()
    store = OffloadStore(directory, engine_identity(engine, engine_dir), layout, host_bytes=host_bytes,
                         disk_bytes=disk_bytes)
    return StateOffload(store, engine.block_size, multi_rank=engine.comm is not None)


class StateOffload:
    """The scheduler's side of the offload store: which rows to read after which step (`take_reads`, applied by
    `reads_done`), and at admission the deepest stored state of a prompt (`find`) and the loads that bring it back
    (`take_loads`)."""

    def __init__(self, store: OffloadStore, block_size: int, *, multi_rank: bool = False) -> None:
        self.store = store
        self.block_size = block_size
        self.multi_rank = multi_rank  # under mpiexec: loads are agreed by all ranks (`AgreePlan`)
        # rank 0, multi-rank: runs an AgreePlan on every rank, in order with the steps (set by the engine core)
        self.agree = None
        self._tickets = 0
        self._held: dict[int, FoundState] = {}  # agreed states by ticket, until their load
        self._reads: list[StateRead] = []
        self._loads: list[StateLoad] = []
        self._queued: set[str] = set()  # entries read or being read, not yet stored
        self.loaded_tokens = 0  # prompt tokens whose state came from the store

    # ---- write-through ----
    def blocks_named(self, names: list[bytes], blocks: list[int]) -> None:
        """Blocks the prefix cache just named: read them after the step that computed them."""
        todo = [(h, b) for h, b in zip(names, blocks)
                if not self.store.has_block(h) and OffloadStore.block_entry(h) not in self._queued]
        if todo:
            self._queued.update(OffloadStore.block_entry(h) for h, _ in todo)
            self._reads.append(StateRead(blocks=[b for _, b in todo], names=[h for h, _ in todo]))

    def checkpoint_named(self, name: bytes, checkpoint: int, partial: PartialCheckpoint | None = None) -> None:
        """A checkpoint the prefix cache committed: the state right after the full block named `name` (a block
        boundary), or with `partial` at an exact position: after the full blocks named `partial.parent`, its
        `partial.tail` tokens in block `partial.block`, whose rows go with it (as `session_kept`'s tail)."""
        if partial is None:
            self._state_read(StateRead(checkpoint=checkpoint, prefix=name))
            return
        tail = tuple(int(t) for t in partial.tail)
        self._state_read(StateRead(checkpoint=checkpoint, prefix=partial.parent, tail=tail,
                                   tail_block=partial.block if tail else None))

    def session_kept(self, tokens: np.ndarray, hashes: list[bytes], slot: int, blocks: list[int]) -> None:
        """A kept session (`tokens` [n], the chained hashes of its full blocks, its slot and blocks): its full blocks
        and its state at its exact end (the tail block's rows with it)."""
        bs = self.block_size
        k = len(tokens) // bs
        self.blocks_named(hashes[:k], blocks[:k])
        tail = tuple(int(t) for t in tokens[k * bs:])
        self._state_read(StateRead(slot=slot, prefix=hashes[k - 1] if k else b"", tail=tail,
                                   tail_block=blocks[k] if tail else None))

    def _state_read(self, read: StateRead) -> None:
        entry = OffloadStore.state_entry(read.prefix, read.tail)
        if entry in self._queued or self.store.has_state(read.prefix, read.tail):
            return
        self._queued.add(entry)
        self._reads.append(read)

    def take_reads(self) -> list[StateRead]:
        reads, self._reads = self._reads, []
        return reads

    def reads_done(self, reads: list[StateRead], rows: list[dict[str, np.ndarray]] | None) -> None:
        """Store what a step read (rows None: the step failed, the reads are dropped)."""
        for read, out in zip(reads, rows if rows is not None else [None] * len(reads)):
            if read.is_state:
                self._queued.discard(OffloadStore.state_entry(read.prefix, read.tail))
                if out is not None:
                    self.store.put_state(read.prefix, read.tail, out)
                continue
            for i, h in enumerate(read.names):
                self._queued.discard(OffloadStore.block_entry(h))
                if out is not None:
                    self.store.put_block(h, {k: v[i] for k, v in out.items()})

    def read_now(self, read_rows) -> None:
        """Read what is queued now with `read_rows(ReadPlan) -> rows` (on every rank): only while no step is in flight
        (the engine core is idle, or shutting down), so that an idle server's last turns are on disk without waiting
        for a next step."""
        reads = self.take_reads()
        if reads:
            self.reads_done(reads, read_rows(ReadPlan(reads)))

    # ---- loads ----
    def find(self, hashes: list[bytes], key, prompt_len: int, beat: int, cached_block) -> FoundState | None:
        """The deepest stored state of a prompt (full-block `hashes`, `key` its tokens [n] int64) beyond position
        `beat` and at most prompt_len - 1 (its last token is fed), whose full blocks are each in the device's prefix
        cache (`cached_block(h)` not None) or in the store; None when there is none (or its files fail their
        checks; under mpiexec: or some rank's copy of the deepest one is missing or fails its check, `AgreePlan`)."""
        bs, last = self.block_size, prompt_len - 1
        if beat >= last:
            return None
        avail = 0
        while avail < len(hashes) and avail * bs < last and (
                cached_block(hashes[avail]) is not None or self.store.has_block(hashes[avail])):
            avail += 1
        for k in range(min(avail, last // bs), -1, -1):
            if k * bs + bs - 1 <= beat:
                return None
            prefix = hashes[k - 1] if k else b""
            for tail in self.store.tails(prefix):
                pos = k * bs + len(tail)
                if pos > last or pos <= beat or len(tail) >= bs:
                    continue
                if not np.array_equal(np.asarray(key[k * bs:pos], dtype=np.int64), np.asarray(tail, dtype=np.int64)):
                    continue
                state = self.store.get_state(prefix, tail)
                if state is None:
                    continue
                names = {i: hashes[i] for i in range(k) if cached_block(hashes[i]) is None}
                missing = {}
                for i, h in names.items():
                    rows = self.store.get_block(h)
                    if rows is None:
                        return None
                    missing[i] = rows
                if not self.multi_rank:
                    return FoundState(k, pos, state, missing)
                self._tickets += 1  # every rank must hold its own valid copy, else no rank loads
                self.agree(AgreePlan(self._tickets, prefix, tuple(tail), k, pos, names))
                return FoundState(k, pos, state, missing, self._tickets) if self._tickets in self._held else None
        return None

    def fetch(self, plan: AgreePlan) -> FoundState | None:
        """This rank's copy of an `AgreePlan`'s state (checked; None when a file is missing or fails its check)."""
        state = self.store.get_state(plan.prefix, plan.tail)
        if state is None:
            return None
        missing = {}
        for i, h in plan.missing.items():
            rows = self.store.get_block(h)
            if rows is None:
                return None
            missing[i] = rows
        return FoundState(plan.blocks, plan.position, state, missing, plan.ticket)

    def hold(self, ticket: int, found: FoundState) -> None:
        self._held[ticket] = found

    def claim(self, ticket: int) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
        """The rows of an agreed state (`load_rows`), no longer held. Loads come in ticket order, so an older held
        ticket is one whose admission gave up (no room): dropped."""
        for old in [t for t in self._held if t < ticket]:
            del self._held[old]
        return self.load_rows(self._held.pop(ticket))[:2]

    def load_rows(self, found: FoundState) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]], list[int]]:
        """What brings `found` back: its state rows, the rows of the blocks to write (pool key -> each block's row,
        the store's arrays themselves: no copy of them all is made before the runner writes each into its place)
        and their indices in the block table (the missing full blocks, then the tail's block)."""
        state = {k[len(STATE_PREFIX):]: v for k, v in found.state.items() if k.startswith(STATE_PREFIX)}
        targets = self.load_targets(found)
        rows = [found.missing[i] for i in targets[:len(found.missing)]]
        if len(targets) > len(found.missing):
            rows.append({k[len(TAIL_PREFIX):]: v for k, v in found.state.items() if k.startswith(TAIL_PREFIX)})
        block_rows = {k: [r[k] for r in rows] for k in self.store.block_keys} if rows else {}
        return state, block_rows, targets

    def load_targets(self, found: FoundState) -> list[int]:
        """The block-table indices a load of `found` writes: its missing full blocks, then its tail's block."""
        return sorted(found.missing) + ([found.blocks] if found.position > found.blocks * self.block_size else [])

    def load(self, slot: int, found: FoundState, blocks: list[int]) -> None:
        """Queue the writes that bring `found` into `slot` and `blocks` (the sequence's block table); under
        mpiexec each rank writes its own rows, held under `found.ticket`."""
        state, block_rows, targets = self.load_rows(found) if found.ticket is None else ({}, {}, self.load_targets(found))
        self._loads.append(StateLoad(slot, state, [blocks[i] for i in targets], block_rows, found.ticket))

    def take_loads(self) -> list[StateLoad]:
        loads, self._loads = self._loads, []
        return loads

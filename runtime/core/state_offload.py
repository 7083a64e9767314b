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

An entry is one safetensors file (raw uint8 rows, never pickle) in the store's directory, written to a temporary
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

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_export.common.engine_config import CONFIG
from moe_export.common.manifest import MANIFEST
from moe_export.runtime.core.prefix_cache import PartialCheckpoint

SUFFIX = ".safetensors"
STATE_PREFIX = "state/"  # tensor names of a state entry: the slot's recurrent rows ...
TAIL_PREFIX = "tail/"  # ... and the partial last block's rows (a state whose tail is not empty)


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
    """Rows to write into the runner before a step's chunks: cache `blocks` [n] (rows: pool key -> uint8 [n, bytes])
    and the recurrent state of `slot` (pool key -> uint8 [bytes]). Under mpiexec the rows are each rank's own: the
    load names the `ticket` of the `AgreePlan` that fetched them (state and block_rows are empty)."""

    slot: int
    state: dict[str, np.ndarray]
    blocks: list[int]
    block_rows: dict[str, np.ndarray]
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


def engine_identity(engine, engine_dir: str | Path) -> bytes:
    """What an offloaded row is valid for: the runner class, its pool layout (`state_layout`: key -> kind, bytes,
    dtype, row shape), block size, and the engine's manifest.json (every file's sha256, weights included: another
    build is another engine; config.json where an engine has no manifest)."""
    root = Path(engine_dir)
    manifest = root / MANIFEST
    files = manifest.read_bytes() if manifest.is_file() else (root / CONFIG).read_bytes()  # hashed, not parsed
    desc = json.dumps([f"{type(engine).__module__}.{type(engine).__qualname__}", engine.block_size,
                       engine.state_layout()], sort_keys=True, default=str)
    return hashlib.blake2b(desc.encode() + files, digest_size=16).digest()


def read_header(data: bytes) -> dict:
    """The safetensors header of a file's bytes (ValueError when it has none that parses)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("truncated header")
    return json.loads(data[8:8 + n])


def contents_digest(identity: bytes, entry: str, arrays: dict[str, np.ndarray]) -> str:
    """The hash binding an entry's identity, what it is (`entry`: its key) and its contents."""
    h = hashlib.blake2b(identity + entry.encode(), digest_size=32)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + str(a.shape).encode() + str(a.dtype).encode())
        h.update(a.tobytes())
    return h.hexdigest()


class OffloadStore:
    """Entries (name -> uint8 arrays) in host memory (LRU within `host_bytes`) and in safetensors files in
    `directory` (LRU by last use, the file's mtime across restarts, within `disk_bytes`). Files are written by one
    background thread; `close()` waits for them. Blocks are named by their chained hash; states by (prefix hash,
    tail tokens). Thread-safe."""

    def __init__(self, directory: str | Path, identity: bytes, layout: dict, *, host_bytes: int, disk_bytes: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.block_keys = {k: v for k, v in layout.items() if v[0] == "cache"}
        self.state_keys = {k: v for k, v in layout.items() if v[0] == "state"}
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self._host: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._host_used = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recently used first
        self._disk_used = 0
        self._entries: dict[str, str] = {}  # file name -> entry key (what it holds), in either tier
        self._blocks: set[bytes] = set()
        self._tails: dict[bytes, set[tuple[int, ...]]] = {}
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="moe-export-offload")
        self.warmed = 0  # files read into host memory at start
        # files loaded, rejected by their check, written, evicted by the cap; writes that failed (and the last why)
        self.loaded = self.rejected = self.written = self.evicted = self.write_errors = 0
        self.last_write_error = ""
        self._scan()
        self._warm()

    # ---- names ----
    def block_file(self, name: bytes) -> str:
        return "b-" + hashlib.blake2b(self.identity + b"block" + name, digest_size=16).hexdigest() + SUFFIX

    def state_file(self, prefix: bytes, tail: tuple[int, ...]) -> str:
        data = prefix + np.asarray(tail, dtype=np.int64).tobytes()
        return "s-" + hashlib.blake2b(self.identity + b"state" + data, digest_size=16).hexdigest() + SUFFIX

    @staticmethod
    def block_entry(name: bytes) -> str:
        return "block:" + name.hex()

    @staticmethod
    def state_entry(prefix: bytes, tail: tuple[int, ...]) -> str:
        return "state:" + prefix.hex() + ":" + ",".join(map(str, tail))

    def _index(self, file: str, entry: str) -> None:
        self._entries[file] = entry
        kind, rest = entry.split(":", 1)
        if kind == "block":
            self._blocks.add(bytes.fromhex(rest))
        else:
            prefix, tail = rest.split(":")
            self._tails.setdefault(bytes.fromhex(prefix), set()).add(tuple(int(t) for t in tail.split(",") if t))

    def _unindex(self, file: str) -> None:
        entry = self._entries.pop(file, None)
        if entry is None:
            return
        kind, rest = entry.split(":", 1)
        if kind == "block":
            self._blocks.discard(bytes.fromhex(rest))
        else:
            prefix, tail = rest.split(":")
            tails = self._tails.get(bytes.fromhex(prefix), set())
            tails.discard(tuple(int(t) for t in tail.split(",") if t))

    def _scan(self) -> None:
        """Index this identity's files (oldest use first); leftover temporary files are removed, files of another
        identity or without a header that parses are left alone and never loaded."""
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                with path.open("rb") as f:
                    head = f.read(8)
                    (n,) = struct.unpack("<Q", head)
                    meta = json.loads(f.read(min(n, 1 << 20)))["__metadata__"]
                if meta["identity"] != self.identity.hex():
                    continue
                st = path.stat()
                found.append((st.st_mtime_ns, path.name, st.st_size, meta["entry"]))
            except (OSError, ValueError, KeyError, TypeError, struct.error):
                continue
        for _, name, size, entry in sorted(found):
            self._disk[name] = size
            self._disk_used += size
            self._index(name, entry)
        self._evict_disk()

    def _warm(self) -> None:
        """Read the most recently used files (checked) into host memory, up to `host_bytes` (HiCache's prefetch, at
        start): a restarted server's first requests read memory, not disk. Their LRU order is left as it was."""
        budget = self.host_bytes
        for file in reversed(list(self._disk)):
            size = self._disk.get(file, 0)
            if size > budget:
                break
            budget -= size
            entry = self._entries.get(file, "")
            keys, prefix = (self.block_keys, "") if entry.startswith("block:") else (self.state_keys, STATE_PREFIX)
            self.warmed += self._get(file, entry, keys, prefix, touch=False) is not None

    # ---- queries ----
    def has_block(self, name: bytes) -> bool:
        with self._lock:
            return name in self._blocks

    def has_state(self, prefix: bytes, tail: tuple[int, ...]) -> bool:
        with self._lock:
            return tail in self._tails.get(prefix, ())

    def tails(self, prefix: bytes) -> list[tuple[int, ...]]:
        """The tails of the states stored after `prefix`, longest first."""
        with self._lock:
            return sorted(self._tails.get(prefix, ()), key=len, reverse=True)

    @property
    def disk_used(self) -> int:
        with self._lock:
            return self._disk_used

    # ---- get ----
    def get_block(self, name: bytes) -> dict[str, np.ndarray] | None:
        return self._get(self.block_file(name), self.block_entry(name), self.block_keys, "")

    def get_state(self, prefix: bytes, tail: tuple[int, ...]) -> dict[str, np.ndarray] | None:
        arrays = self._get(self.state_file(prefix, tail), self.state_entry(prefix, tail), self.state_keys, STATE_PREFIX)
        if arrays is None or not tail:
            return arrays
        if not all(TAIL_PREFIX + k in arrays and arrays[TAIL_PREFIX + k].nbytes == v[1] for k, v in self.block_keys.items()):
            self._reject(self.state_file(prefix, tail))
            return None
        return arrays

    def _get(self, file: str, entry: str, keys: dict, prefix: str, touch: bool = True) -> dict[str, np.ndarray] | None:
        """An entry's arrays from host memory, else from its file, checked (None: absent or rejected); `touch`: a
        use (most recently used now)."""
        with self._lock:
            if self._entries.get(file) != entry:
                return None
            if file in self._host:
                if touch:
                    self._host.move_to_end(file)
                    if file in self._disk:
                        self._disk.move_to_end(file)
                return self._host[file]
        path = self.dir / file
        try:
            data = path.read_bytes()
            arrays = self._check(data, entry)
        except Exception:  # unreadable, not safetensors (SafetensorError), or not what its header says
            self._reject(file)
            return None
        if not all(prefix + k in arrays and arrays[prefix + k].nbytes == v[1] for k, v in keys.items()):
            self._reject(file)
            return None
        with self._lock:
            self.loaded += 1
            if file in self._disk and touch:
                self._disk.move_to_end(file)
            self._put_host(file, arrays, front=not touch)
        if touch:
            try:
                os.utime(path)  # its last use, for the LRU order after a restart
            except OSError:
                pass
        return arrays

    def _check(self, data: bytes, entry: str) -> dict[str, np.ndarray]:
        """The arrays of a file's bytes if its header names this identity and `entry` and its contents hash to its
        digest (ValueError otherwise)."""
        from safetensors.numpy import load

        meta = read_header(data).get("__metadata__") or {}
        if meta.get("identity") != self.identity.hex():
            raise ValueError("another engine's entry")
        if meta.get("entry") != entry:
            raise ValueError("another entry")
        arrays = load(data)
        if any(a.dtype != np.uint8 for a in arrays.values()):
            raise ValueError("rows are not raw bytes")
        if contents_digest(self.identity, entry, arrays) != meta.get("digest"):
            raise ValueError("contents do not match their hash")
        return arrays

    def _reject(self, file: str) -> None:
        """Forget an entry whose file failed its check, and delete that file (its name is this identity's)."""
        with self._lock:
            self.rejected += 1
            self._host.pop(file, None)
            size = self._disk.pop(file, None)
            if size is not None:
                self._disk_used -= size
            self._unindex(file)
        (self.dir / file).unlink(missing_ok=True)

    # ---- put ----
    def put_block(self, name: bytes, arrays: dict[str, np.ndarray]) -> None:
        self._put(self.block_file(name), self.block_entry(name), arrays)

    def put_state(self, prefix: bytes, tail: tuple[int, ...], arrays: dict[str, np.ndarray]) -> None:
        self._put(self.state_file(prefix, tail), self.state_entry(prefix, tail), arrays)

    def _put(self, file: str, entry: str, arrays: dict[str, np.ndarray]) -> None:
        arrays = {k: np.ascontiguousarray(v).reshape(-1).view(np.uint8) for k, v in arrays.items()}
        with self._lock:
            if self._entries.get(file) == entry:
                return
            self._index(file, entry)
            self._put_host(file, arrays)
        self._writer.submit(self._write, file, entry, arrays)

    def _put_host(self, file: str, arrays: dict[str, np.ndarray], front: bool = False) -> None:
        """Keep an entry in host memory (most recently used; `front`: least, the warm-up's older files), evicting the
        least recently used beyond `host_bytes`."""
        if file in self._host:
            return
        self._host[file] = arrays
        if front:
            self._host.move_to_end(file, last=False)
        self._host_used += sum(a.nbytes for a in arrays.values())
        while self._host_used > self.host_bytes and self._host:
            old, rows = self._host.popitem(last=False)
            self._host_used -= sum(a.nbytes for a in rows.values())
            if old not in self._disk:
                self._unindex(old)

    def _write(self, file: str, entry: str, arrays: dict[str, np.ndarray]) -> None:
        """The writer thread: the entry's file, written to a temporary name, synced and renamed."""
        from safetensors.numpy import save

        meta = {"identity": self.identity.hex(), "entry": entry, "digest": contents_digest(self.identity, entry, arrays)}
        data = save(arrays, metadata=meta)
        tmp = self.dir / f".{file}.{os.getpid()}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / file)
        except OSError as exc:  # (a full disk): the entry stays in host memory only
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.write_errors += 1
                self.last_write_error = f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self.written += 1
            if self._entries.get(file) != entry:  # (forgotten meanwhile: evicted from host memory before written)
                self._index(file, entry)
            if file not in self._disk:
                self._disk[file] = len(data)
                self._disk_used += len(data)
            self._evict_disk()

    def _evict_disk(self) -> None:
        """Delete least recently used files until the directory is within `disk_bytes`."""
        while self._disk_used > self.disk_bytes and self._disk:
            old, size = self._disk.popitem(last=False)
            self._disk_used -= size
            self.evicted += 1
            (self.dir / old).unlink(missing_ok=True)
            if old not in self._host:
                self._unindex(old)

    def close(self) -> None:
        """Wait for the files being written."""
        self._writer.shutdown(wait=True)


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

    def claim(self, ticket: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The rows of an agreed state (`load_rows`), no longer held. Loads come in ticket order, so an older held
        ticket is one whose admission gave up (no room): dropped."""
        for old in [t for t in self._held if t < ticket]:
            del self._held[old]
        return self.load_rows(self._held.pop(ticket))[:2]

    def load_rows(self, found: FoundState) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[int]]:
        """What brings `found` back: its state rows, the rows of the blocks to write (pool key -> [n, bytes]) and
        their indices in the block table (the missing full blocks, then the tail's block)."""
        state = {k[len(STATE_PREFIX):]: v for k, v in found.state.items() if k.startswith(STATE_PREFIX)}
        targets = self.load_targets(found)
        rows = [found.missing[i] for i in targets[:len(found.missing)]]
        if len(targets) > len(found.missing):
            rows.append({k[len(TAIL_PREFIX):]: v for k, v in found.state.items() if k.startswith(TAIL_PREFIX)})
        block_rows = {k: np.stack([r[k] for r in rows]) for k in self.store.block_keys} if rows else {}
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

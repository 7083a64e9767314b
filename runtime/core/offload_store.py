"""The offload store's files and host tier (`core.state_offload` decides what goes in and comes out): entries of
uint8 arrays, each one safetensors file written to a temporary name and renamed, its header binding the engine
identity (`engine_identity`), what the entry is and a hash of both and the contents (`contents_digest`); a file that
does not parse, is truncated, names another identity or entry, or does not hash to its header is never loaded."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moe_export.common.engine_config import CONFIG
from moe_export.common.manifest import MANIFEST

SUFFIX = ".safetensors"
STATE_PREFIX = "state/"  # tensor names of a state entry: the slot's recurrent rows ...
TAIL_PREFIX = "tail/"  # ... and the partial last block's rows (a state whose tail is not empty)


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

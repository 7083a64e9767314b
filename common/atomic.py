"""Crash-safe file writes: every file is written under a temporary name in its final folder, flushed,
and renamed over the final name with `os.replace`, so a reader (or a resumed build) sees either the
old file or the complete new one, never a partial write.

Temporary names are `.{name}.tmp-{pid}`; `sweep_temporaries` removes those a killed process left.
JSON artifacts use `canonical_json`: sorted keys, fixed indentation, no wall-clock data, and
non-finite floats spelled as strings, so equal content always serializes to equal bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEMP_RE = re.compile(r"^\..+\.tmp-\d+$")
HASH_CHUNK = 1 << 20


def temp_path(path: Path) -> Path:
    """The temporary sibling a write of `path` goes to before its rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (after a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on normal exit it is flushed and renamed to `path`,
    on an exception it is removed and `path` is left as it was."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(f"{tmp}: the writer produced no file for {final}")
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> bytes:
    """Deterministic UTF-8 JSON: sorted keys, 2-space indent, trailing newline; inf/nan as strings."""
    return (json.dumps(_json_safe(obj), sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, canonical_json(obj))


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sweep_temporaries(root: Path) -> list[Path]:
    """Remove temporary files (and temporary folders named like them) left under `root` by killed writers."""
    removed = []
    if not root.is_dir():
        return removed
    for dirpath, dirnames, filenames in os.walk(root):
        for name in list(dirnames):
            if TEMP_RE.match(name):
                shutil.rmtree(Path(dirpath) / name, ignore_errors=True)
                dirnames.remove(name)
                removed.append(Path(dirpath) / name)
        for name in filenames:
            if TEMP_RE.match(name):
                (Path(dirpath) / name).unlink(missing_ok=True)
                removed.append(Path(dirpath) / name)
    return removed

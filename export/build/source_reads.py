"""What a convert stage read from the source checkpoint, and whether the source still holds those bytes.

A fresh build reads each source byte it needs once: the converter's reads go through the one
`CheckpointReader` inside `read_log()`, which hashes every tensor slice as it is returned. No pass hashes
the source files beforehand. The convert stage's record (`.state/convert-rankN.json`) keeps, under
"source":

    "files":  {shard file: {"reads": [[stored name, part, sha256], ...], "stamp": {...} | null}}
    "digest": sha256 of the canonical JSON of {shard file: reads}: the identity of the bytes the rank read

`part` is null (whole tensor) or [dim, start, stop]; `stamp` is the file's (st_dev, st_ino, st_size,
st_mtime_ns, st_ctime_ns) taken after the reads.

The rule that decides whether convert/rankN is up to date (`check`), before any tensor data is read:

1. Its key (`stage_keys.convert_key`) must be unchanged: recipe fields, code, the rank's mapping, and the
   source layout (sha256 of config.json and of the shard headers' tensor table: name, file, dtype, shape,
   byte range). Any structural change reruns the stage. The outputs must be intact (size, mtime, inode).
2. Every shard file the rank read whose current stamp equals the recorded one is taken as unchanged:
   nothing of it is read.
3. Every other shard file (stamp differs, or none was recorded) is re-read: exactly the rank's recorded
   slices of it, hashed and compared with the recorded digests. All equal: the stage is up to date and
   the record gets the new stamps. Any difference (or a tensor that cannot be read): the stage reruns.

A stamp is recorded only when the file's ctime is at least `RACY_NS` older than the start of the reads
(`null` otherwise): a file written within a timestamp tick of being read could be written again without
changing its stamp, so such a file is verified by content at the next build. ctime is part of the stamp
because no user-level call sets it: restoring an edited file's mtime still changes its ctime. Trusting a
stamp therefore assumes the timestamps come from a clock within `RACY_NS` of this machine's (local
filesystems; a network filesystem's server clock may be further off) — the trust make and git place in
file times, with content verification whenever the stamp moved.

The identity that downstream stages' keys use is `stage_keys.convert_identity(key, digest)`: a changed
byte that the rank reads changes it; a byte no rank reads cannot change any output.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from moe_export.common.atomic import canonical_json
from moe_export.common.errors import InputError

# A file changed less than this before the reads began gets no stamp (ns; covers coarse file timestamp
# granularity, up to the 2 s of FAT, and small clock differences).
RACY_NS = 2_000_000_000

T = TypeVar("T")


def stamp(path: Path) -> dict[str, int]:
    """The stat fields that change when a file's content can have changed (OSError if it is gone)."""
    st = os.stat(path)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _trusted_stamp(path: Path, started_ns: int) -> dict[str, int] | None:
    st = stamp(path)
    return st if st["ctime_ns"] < started_ns - RACY_NS else None


def reads_digest(files: dict[str, dict]) -> str:
    """sha256 (hex) of the reads of every file (stamps excluded): the identity of the bytes read."""
    return hashlib.sha256(canonical_json({f: e["reads"] for f, e in files.items()})).hexdigest()


def record_reads(reader, run: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """Run `run()` (a convert) with every tensor read through `reader` hashed; returns its result and the
    "source" record described in the module docstring."""
    started = time.time_ns()
    with reader.read_log() as log:
        result = run()
    files: dict[str, dict] = {}
    for (file, name, part), digest in sorted(log.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or ())):
        files.setdefault(file, {"reads": []})["reads"].append([name, None if part is None else list(part), digest])
    for file, entry in files.items():
        entry["stamp"] = _trusted_stamp(reader.path / file, started)
    return result, {"files": files, "digest": reads_digest(files)}


def check(reader, source: dict[str, Any] | None, note: Callable[[str], None] = lambda msg: None) -> dict | None:
    """Whether the source still holds the bytes `source` (a convert record's "source") lists.

    Returns `source` itself when every stamp matches (nothing read), an updated copy with new stamps when
    the re-read files hold the same bytes, None when a byte differs or cannot be read (rerun the stage).
    `note` receives one line when files are re-read."""
    if not _well_formed(source):
        return None
    files = source["files"]
    stale = []
    for file, entry in files.items():
        try:
            if entry.get("stamp") is None or stamp(reader.path / file) != entry["stamp"]:
                stale.append(file)
        except OSError:
            return None
    if not stale:
        return source
    nbytes = sum(_part_bytes(reader, name, part) for f in stale for name, part, _ in files[f]["reads"])
    fresh = sum(files[f].get("stamp") is None for f in stale)
    why = [f"{len(stale) - fresh} whose timestamps or inode changed since"] if len(stale) > fresh else []
    why += [f"{fresh} written less than {RACY_NS / 1e9:g} s before being read"] if fresh else []
    note(f"re-reading the {nbytes / 2**20:.1f} MiB this rank reads of {len(stale)} source file(s) to compare "
         f"with the bytes it converted ({', '.join(why)})")
    started = time.time_ns()
    reader.close()  # fresh memory maps: the bytes of the files as they are now
    order = {f: i for i, f in enumerate(reader.files)}
    for file in sorted(stale, key=lambda f: order.get(f, len(order))):
        for name, part, digest in files[file]["reads"]:
            try:
                if reader.stored(name).file != file or reader.digest(name, part) != digest:
                    return None
            except (KeyError, InputError, OSError):
                return None
        reader.release(file)
    try:
        renewed = {f: {**e, "stamp": _trusted_stamp(reader.path / f, started)} if f in stale else e
                   for f, e in files.items()}
    except OSError:
        return None
    return {**source, "files": renewed}


def _well_formed(source: Any) -> bool:
    """A "source" record as `record_reads` writes it, its digest matching its reads."""
    if not isinstance(source, dict) or not isinstance(source.get("files"), dict):
        return False
    if not isinstance(source.get("digest"), str):
        return False
    for entry in source["files"].values():
        if not (isinstance(entry, dict) and isinstance(entry.get("reads"), list)
                and all(isinstance(r, list) and len(r) == 3 for r in entry["reads"])):
            return False
    return source["digest"] == reads_digest(source["files"])


def _part_bytes(reader, name: str, part: list[int] | None) -> int:
    """Bytes of the stored tensor `name` (or of its slice `part`); 0 if the checkpoint has no such tensor."""
    if name not in reader:
        return 0
    stored = reader.stored(name)
    if part is None:
        return stored.nbytes
    dim, start, stop = part
    return stored.nbytes // stored.shape[dim] * (stop - start) if stored.shape[dim] else 0

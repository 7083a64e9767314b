"""Stage records of a build (`.state/`), the scratch folders stages work in, and how a failed stage is reported.

An output is staged at `.build/<rel>` until publish renames it to `OUT/<rel>`; a record names each output with
its size, mtime, inode and sha256, so a stage whose key is unchanged and whose outputs are intact is not rerun.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe_export.common.atomic import atomic_write_json, fsync_path, sha256_file
from moe_export.common.errors import BuildError

QUANT_REPORT = "quantization.json"


class StageRecords:
    """`.state/<stage>[-rankN].json` records: key, outputs (size, mtime, inode, sha256) and the stage's result;
    `locate` finds an output staged in .build or published in OUT by its recorded size, mtime and inode."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.folder = out / ".state"
        self.build = out / ".build"

    def _path(self, name: str) -> Path:
        return self.folder / (name.replace("/", "-") + ".json")

    def load(self, name: str) -> dict | None:
        try:
            rec = json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def locate(self, rel: str, meta: dict) -> Path | None:
        """The output `rel` as recorded in `meta`: staged in .build, published in OUT, or None if neither
        holds it intact."""
        for path in (self.build / rel, self.out / rel):
            try:
                st = path.stat()
            except OSError:
                continue
            if (st.st_size, st.st_mtime_ns, st.st_ino) == (meta.get("size"), meta.get("mtime_ns"), meta.get("ino")):
                return path
        return None

    def current(self, name: str, key: str) -> dict | None:
        """The record if it has `key` and its outputs are intact, else None."""
        rec = self.load(name)
        if rec is None or rec.get("key") != key or not isinstance(rec.get("outputs"), dict):
            return None
        if any(self.locate(rel, meta) is None for rel, meta in rec["outputs"].items()):
            return None
        return rec

    def output(self, name: str, rel: str) -> Path:
        """Where the output `rel` of the finished stage `name` is now."""
        rec = self.load(name) or {}
        meta = rec.get("outputs", {}).get(rel)
        path = None if meta is None else self.locate(rel, meta)
        if path is None:
            raise BuildError(f"stage {name}: its output {rel} is gone (was the output folder modified meanwhile?)")
        return path

    def write(self, name: str, obj: Any) -> None:
        atomic_write_json(self._path(name), obj)

    def record(self, name: str, key: str, outputs: list[str], result: Any, source: dict | None = None) -> dict:
        """Record a finished stage: its key, its outputs staged in .build, its result and (convert) what it
        read of the source (`source_reads`)."""
        metas = {}
        for rel in outputs:
            path = self.build / rel
            st = path.stat()
            metas[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "sha256": sha256_file(path)}
        rec = {"stage": name, "key": key, "outputs": metas, "result": result}
        if source is not None:
            rec["source"] = source
        self.write(name, rec)
        return rec


DISK_FULL_ERRNOS = (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)
RUST_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) report errno


def _errno_of(exc: BaseException) -> int | None:
    """The OS error number behind `exc`: an OSError in its chain, or one quoted in its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    m = RUST_OS_ERROR_RE.search(str(exc))
    return int(m.group(1)) if m else None


def stage_failed(what: str, exc: Exception) -> BuildError:
    hint = ""
    if _errno_of(exc) in DISK_FULL_ERRNOS:
        hint = " (the disk is full or a file size limit was reached; the previous output is untouched)"
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return BuildError(f"{what} failed: {exc.strerror or exc}{where}{hint}")
    return BuildError(f"{what} failed: {type(exc).__name__}: {exc}{hint}")


@contextlib.contextmanager
def scratch(rdir: Path, name: str, inputs: dict[str, Path]) -> Iterator[Path]:
    """A temporary folder inside the rank folder (same filesystem, so results can be renamed out) that
    shows each of `inputs` under its name. They are symbolic links: a hard link would give the file a
    second link, and a published one keeps exactly one."""
    tmp = rdir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for link_name, target in inputs.items():
            os.symlink(os.path.abspath(target), tmp / link_name)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into(src: Path, dst: Path) -> None:
    fsync_path(src)
    os.replace(src, dst)

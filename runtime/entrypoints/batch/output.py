"""The batch output file: one JSON line per item, whole or absent after a kill, resumable.

Each line is written with one `write` on an O_APPEND descriptor and fsynced before the next; on open,
a tail without its newline (a write cut by a kill) is truncated away, so every line left is complete.
Lines are OpenAI batch output records: {"id", "custom_id", "response": {status_code, request_id, body} |
null, "error": {code, message} | null}; document items also carry "content_hash". A document whose content
changed since its line was written has its old line removed (`drop`, an atomic rewrite) before it is redone,
so the output holds one line per document.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_export.common.atomic import atomic_path
from moe_export.common.errors import InputError


def record_key(record: dict) -> str:
    """What a rerun skips on: custom_id, plus the content hash for documents."""
    if record.get("content_hash"):
        return f"{record['custom_id']}@{record['content_hash']}"
    return str(record["custom_id"])


class ResultLog:
    """Append-only JSONL output; `done` holds the keys of the items already in it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise InputError(f"--output {path}: is a folder; give the output file's path, e.g. {self.path / 'results.jsonl'}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[str] = set()
        self.failed: set[str] = set()  # keys of the error lines among them
        self.hashed: dict[str, set[str]] = {}  # custom_id -> keys of its document lines (custom_id@content_hash)
        self.repaired_bytes = 0
        if self.path.exists():
            self._load_and_repair()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load_and_repair(self) -> None:
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):
            self.repaired_bytes = len(data) - cut
            with open(self.path, "r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
        for line_no, line in enumerate(data[:cut].splitlines(), 1):
            if not line.strip():
                continue
            try:
                self._note(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise InputError(f"{self.path} line {line_no}: not a batch output record; choose another --output") from None

    def _note(self, record: dict) -> None:
        key = record_key(record)
        self.done.add(key)
        if record.get("error") is not None:
            self.failed.add(key)
        if record.get("content_hash"):
            self.hashed.setdefault(str(record["custom_id"]), set()).add(key)

    def stale(self, current: dict[str, str]) -> set[str]:
        """Keys of the document lines whose custom_id is in `current` (custom_id -> the key of its content now)
        under another key: lines of documents that changed since."""
        return {k for cid, key in current.items() for k in self.hashed.get(cid, ()) if k != key}

    def drop(self, keys: set[str]) -> None:
        """Remove the lines with these keys (the file rewritten atomically, then appended to again)."""
        if not keys:
            return
        kept = [line for line in self.path.read_bytes().splitlines(keepends=True)
                if line.strip() and record_key(json.loads(line)) not in keys]
        os.close(self.fd)
        with atomic_path(self.path) as tmp:
            tmp.write_bytes(b"".join(kept))
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.done -= keys
        self.failed -= keys
        for cid in list(self.hashed):
            self.hashed[cid] -= keys

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        self._note(record)

    def close(self) -> None:
        os.close(self.fd)

"""The batch output file: one JSON line per item, whole or absent after a kill, resumable.

Each line is written with one `write` on an O_APPEND descriptor and fsynced before the next; on open,
a tail without its newline (a write cut by a kill) is truncated away, so every line left is complete.
Lines are OpenAI batch output records: {"id", "custom_id", "response": {status_code, request_id, body} |
null, "error": {code, message} | null}; document items also carry "content_hash".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[str] = set()
        self.failed: set[str] = set()  # keys of the error lines among them
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
                record = json.loads(line)
                self.done.add(record_key(record))
                if record.get("error") is not None:
                    self.failed.add(record_key(record))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{self.path} line {line_no}: not a batch output record; choose another --output") from None

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        self.done.add(record_key(record))
        if record.get("error") is not None:
            self.failed.add(record_key(record))

    def close(self) -> None:
        os.close(self.fd)

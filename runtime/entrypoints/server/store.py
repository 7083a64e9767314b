"""Durable server-side history for the Responses API: one SQLite database in WAL mode.

Each completed response is one row, committed in one transaction: the turn's input items and the chat
messages they became, the output items and the assistant message, usage, the parent response id and a
hash of the API key that created it. A chain is rebuilt by walking parent ids, so it survives restarts;
a process killed mid-response leaves no row at all (nothing is written before the response completes).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moe_export.common.errors import InputError

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    key_scope TEXT NOT NULL,
    parent_id TEXT,
    created_at INTEGER NOT NULL,
    input_items TEXT NOT NULL,
    input_messages TEXT NOT NULL,
    output_message TEXT NOT NULL,
    response TEXT NOT NULL
)
"""


def key_scope(api_key: str | None) -> str:
    """The stored owner of a response: sha256 of the API key ('' when the server runs without auth)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class MissingResponse(LookupError):
    """A response of a chain is not in the store (never stored, deleted, or another key's)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass
class StoredResponse:
    """One stored turn. input_messages: this turn's new chat messages (history excluded); output_message:
    the assistant message (reasoning_content, content, tool_calls); response: the Responses API object."""

    id: str
    parent_id: str | None
    input_items: list
    input_messages: list[dict]
    output_message: dict
    response: dict


class ResponseStore:
    """SQLite store at `path` (':memory:' for a throwaway one). Thread-safe; every write is one transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            parent = Path(self.path).parent
            if not parent.is_dir():
                raise InputError(f"--store {self.path}: directory {parent} does not exist")
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise InputError(f"--store {self.path}: not a usable SQLite database ({exc})") from None
        self._lock = threading.Lock()

    def put(self, record: StoredResponse, scope: str) -> None:
        """Commit one completed response (all columns in one transaction)."""
        row = (
            record.id, scope, record.parent_id, int(time.time()), json.dumps(record.input_items),
            json.dumps(record.input_messages), json.dumps(record.output_message), json.dumps(record.response),
        )
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, response_id: str, scope: str) -> StoredResponse | None:
        """The response if it exists and belongs to `scope`, else None (another key's id looks absent)."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, parent_id, input_items, input_messages, output_message, response FROM responses "
                "WHERE id = ? AND key_scope = ?",
                (response_id, scope),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], *(json.loads(v) for v in row[2:]))

    def delete(self, response_id: str, scope: str) -> bool:
        """Remove one response; True if it existed in this scope."""
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND key_scope = ?", (response_id, scope))
        return cur.rowcount > 0

    def history(self, response_id: str, scope: str) -> list[dict]:
        """The chat messages of the whole chain ending at `response_id` (oldest first: each turn's input
        messages, then its assistant message, which carries the turn's token ids); MissingResponse naming
        the first response of the chain that is missing (the response itself or a deleted ancestor)."""
        turns: list[tuple[str, str]] = []  # (input messages, output message) as stored, newest first
        next_id: str | None = response_id
        while next_id is not None:  # (only the columns a history holds: a response object is read by `get`)
            with self._lock:
                row = self._db.execute("SELECT parent_id, input_messages, output_message FROM responses "
                                       "WHERE id = ? AND key_scope = ?", (next_id, scope)).fetchone()
            if row is None:
                raise MissingResponse(next_id)
            next_id = row[0]
            turns.append(row[1:])
        messages: list[dict] = []
        for inputs, output in reversed(turns):
            messages.extend(json.loads(inputs))
            messages.append(json.loads(output))
        return messages

    def close(self) -> None:
        with self._lock:
            self._db.close()

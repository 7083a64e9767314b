"""Session state reuse: finished sequences kept by the exact token sequence their state holds.

A kept sequence owns a recurrent-state slot (KDA state and conv windows at its end position) and
the cache blocks covering its positions. KDA state cannot be rewound, so a new prompt reuses a kept
sequence only when that sequence's tokens are a proper prefix of the prompt; it then takes the slot
and blocks over and prefills only the remaining tokens. Least recently used entries are evicted
when slots or blocks are needed.

A client continues a conversation by sending the assistant's turn back as text (content, reasoning,
tool calls), and encoding that text again need not give the tokens the model sampled. `TurnMemory`
remembers each finished chat turn's tokens by the message it parsed into, so the next prompt renders that
turn as those tokens (`chat.render_ids`, `turn_ids`) and extends the kept sequence.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class KeptSequence:
    """State of `tokens` [n] int64 (positions [0, n), a session key: `Sequence.session_key`) in `slot`, cache in
    `blocks` (one reference held); `hashes`: the prefix-cache names of its full blocks, when computed (a prompt
    that continues it reuses them and hashes only its new blocks); `lineage`: the session it belongs to
    (`core.prefix_cache`)."""

    tokens: np.ndarray
    slot: int
    blocks: list[int]
    hashes: list[bytes] = field(default_factory=list)
    lineage: str = ""

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(self.tokens.tobytes(), digest_size=16).digest()


class SessionCache:
    """LRU map token sequence (by its digest) -> KeptSequence; at most one entry per slot. A prompt is matched
    against the kept sequences by comparing int64 arrays (a memcmp: ~1 ms per million tokens), never by building
    tuples of its tokens."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, KeptSequence] = OrderedDict()
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, seq: KeptSequence) -> KeptSequence | None:
        """Remember `seq` as most recently used; returns an entry it replaced (same tokens), to release."""
        key = seq.digest
        old = self._entries.pop(key, None)
        self._entries[key] = seq
        return old

    def take_longest_prefix(self, prompt: np.ndarray) -> KeptSequence | None:
        """Remove and return the longest kept sequence that is a proper prefix of `prompt` [n] int64 (None: miss)."""
        best = None
        for key, kept in self._entries.items():
            n = len(kept.tokens)
            if n < len(prompt) and (best is None or n > len(self._entries[best].tokens)) \
                    and np.array_equal(prompt[:n], kept.tokens):
                best = key
        if best is None:
            return None
        self.hits += 1
        self.reused_tokens += len(self._entries[best].tokens)
        return self._entries.pop(best)

    def evict_lru(self) -> KeptSequence | None:
        """Remove and return the least recently used entry (None when empty)."""
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[1]


def turn_key(message: dict) -> bytes | None:
    """Digest of an assistant message's parsed form (content, reasoning, tool calls with ids, names and
    argument strings), or None when it is not in that form (e.g. content with images)."""
    content = message.get("content")
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    calls = message.get("tool_calls") or []
    if not all(v is None or isinstance(v, str) for v in (content, reasoning)) or not isinstance(calls, list):
        return None
    parts = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return None
        parts.append([call.get("id"), fn.get("name"), fn.get("arguments")])
    if not all(isinstance(v, str) or v is None for part in parts for v in part):
        return None
    return hashlib.sha256(json.dumps([content or "", reasoning or "", parts]).encode()).digest()


class TurnMemory:
    """Finished chat turns' tokens (generation prompt + output) by `turn_key` of their message; least
    recently used turns are dropped beyond `max_tokens` tokens in all. Thread-safe: requests are rendered on
    the caller's thread while turns finish on the scheduler's."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._turns: OrderedDict[bytes, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def remember(self, message: dict, ids: list[int]) -> None:
        key = turn_key(message)
        if key is None or len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._turns.pop(key, None)
            self._tokens += len(ids) - (len(old) if old is not None else 0)
            self._turns[key] = array("q", ids)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._turns.popitem(last=False)[1])

    def recall(self, message: dict) -> list[int] | None:
        """The tokens of the turn that parsed into `message`, if remembered."""
        key = turn_key(message)
        if key is None:
            return None
        with self._lock:
            ids = self._turns.get(key)
            if ids is None:
                return None
            self._turns.move_to_end(key)
            return ids.tolist()

"""Session state reuse: finished sequences kept by the exact token sequence their state holds.

A kept sequence owns a recurrent-state slot (KDA state and conv windows at its end position) and
the cache blocks covering its positions. KDA state cannot be rewound, so a new prompt reuses a kept
sequence only when that sequence's tokens are a proper prefix of the prompt; it then takes the slot
and blocks over and prefills only the remaining tokens. Least recently used entries are evicted
when slots or blocks are needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KeptSequence:
    """State of `tokens` (positions [0, len(tokens))) in `slot`, cache in `blocks` (one reference held)."""

    tokens: tuple[int, ...]
    slot: int
    blocks: list[int]


class SessionCache:
    """LRU map token sequence -> KeptSequence; at most one entry per slot."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], KeptSequence] = OrderedDict()
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, seq: KeptSequence) -> KeptSequence | None:
        """Remember `seq` as most recently used; returns an entry it replaced (same tokens), to release."""
        old = self._entries.pop(seq.tokens, None)
        self._entries[seq.tokens] = seq
        return old

    def take_longest_prefix(self, prompt: list[int]) -> KeptSequence | None:
        """Remove and return the longest kept sequence that is a proper prefix of `prompt` (None: miss)."""
        best = None
        for key in self._entries:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[: len(key)]) == key:
                best = key
        if best is None:
            return None
        self.hits += 1
        self.reused_tokens += len(best)
        return self._entries.pop(best)

    def evict_lru(self) -> KeptSequence | None:
        """Remove and return the least recently used entry (None when empty)."""
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[1]

"""Split a document into chunks that fit a token budget, consecutive chunks sharing an overlap.

Text is cut only between words (runs of non-space + following space), except inside a word longer than
the budget, which is cut between characters. Each chunk's exact token count (the tokenizer on the joined
text) is <= `budget`; consecutive chunks share the last words of the previous chunk, at most `overlap`
tokens of them (counted word by word), so a sentence cut at a boundary is seen whole by one chunk.
"""

from __future__ import annotations

import re
from collections.abc import Callable

WORD_RE = re.compile(r"\S+\s*|\s+")


def _split_long(unit: str, count: Callable[[str], int], budget: int) -> list[str]:
    """Cut one over-budget word into pieces of <= budget tokens (greedy, by characters)."""
    pieces, start = [], 0
    while start < len(unit):
        lo, hi = start + 1, len(unit)
        while lo < hi:  # longest prefix from `start` that fits
            mid = (lo + hi + 1) // 2
            if count(unit[start:mid]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        pieces.append(unit[start:lo])
        start = lo
    return pieces


def chunk_text(text: str, count: Callable[[str], int], budget: int, overlap: int) -> list[str]:
    """`text` -> chunks of <= `budget` tokens (count(chunk) is the exact measure), overlapping by <= `overlap`."""
    if budget < 1:
        raise ValueError(f"chunk budget must be >= 1 token, got {budget}")
    if not 0 <= overlap < budget:
        raise ValueError(f"overlap must be in [0, budget), got {overlap} (budget {budget})")
    if count(text) <= budget:
        return [text]
    units: list[str] = []
    sizes: list[int] = []
    for unit in WORD_RE.findall(text):
        n = count(unit)
        for piece in ([unit] if n <= budget else _split_long(unit, count, budget)):
            units.append(piece)
            sizes.append(n if len(piece) == len(unit) else count(piece))
    chunks: list[str] = []
    start = 0
    while start < len(units):
        end, total = start, 0
        while end < len(units) and total + sizes[end] <= budget:
            total += sizes[end]
            end += 1
        end = max(end, start + 1)
        while end > start + 1 and count("".join(units[start:end])) > budget:  # joined text can count more
            end -= 1
        chunks.append("".join(units[start:end]))
        if end == len(units):
            break
        back, shared = end, 0
        while back - 1 > start and shared + sizes[back - 1] <= overlap:
            back -= 1
            shared += sizes[back]
        start = back
    return chunks

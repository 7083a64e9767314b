"""Thinking budgets: effort tiers -> reasoning-token caps, and the enforcer that closes reasoning at the cap.

Tiers `low | high | max` map to the engine's `thinking` caps (recipe -> engine config.json); a request may
give a number of tokens instead; `none` turns thinking off. `ReasoningBudget` counts the reasoning tokens
of one request; when the count reaches the cap it hands the runtime the whole close marker, one token per
step (K3: `<|close|>think<|sep|>` then `<|open|>response<|sep|>`; K2: `</think>`), so the model goes on
with its answer. A close tag the model already began is completed, never restarted. Whether the request
is in reasoning follows the newest think marker of the output only (past turns' markers are in the
prompt, which the budget never sees: `starts_in_reasoning` says how the generation prompt ended).

`reasoning_tokens` counts the tokens inside think elements, without the markers; with a cap it never
exceeds the cap, and equals it when the cap is what ended reasoning (less only by the part of a close tag
the model had written itself when the cap was reached: a begun close tag counts toward the cap while it
is written, and is not reasoning once it completes).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_export.common.errors import InputError
from moe_export.graphs.tokens import (
    CALLS_BEGIN,
    CLOSE,
    END_THINK,
    FAMILIES,
    OPEN,
    SEP,
    THINK,
)
from moe_export.runtime.tokenizer import Tokenizer

EFFORT_TIERS = ("low", "high", "max")


@dataclass(frozen=True)
class ThinkingPlan:
    """enabled: the prompt opens reasoning; cap: reasoning-token cap (None = unlimited); tier: the tier
    rendered into the prompt ("none" when disabled)."""

    enabled: bool
    cap: int | None
    tier: str


def resolve_thinking(effort: str | int | None, caps: dict[str, int], default_effort: str) -> ThinkingPlan:
    """The plan for a request's effort: a tier name, "none", a token count (int or digit string), or None
    (`default_effort`). A count renders as the smallest tier whose cap holds it (else "max")."""
    if default_effort not in (*EFFORT_TIERS, "none"):
        raise InputError(f"default thinking effort must be one of low, high, max, none; got {default_effort!r}")
    if effort is None:
        effort = default_effort
    if isinstance(effort, str) and effort.strip().isdigit():
        effort = int(effort.strip())
    if isinstance(effort, int) and not isinstance(effort, bool):
        if effort < 0:
            raise InputError(f"thinking budget must be >= 0 tokens, got {effort}")
        tier = next((t for t in EFFORT_TIERS if t in caps and effort <= caps[t]), "max")
        return ThinkingPlan(enabled=True, cap=effort, tier=tier)
    if effort == "none":
        return ThinkingPlan(enabled=False, cap=None, tier="none")
    if effort in EFFORT_TIERS:
        return ThinkingPlan(enabled=True, cap=caps.get(effort), tier=effort)
    raise InputError(f"reasoning effort must be low, high, max, none or a number of tokens, got {effort!r}")


class ReasoningBudget:
    """Per-request reasoning counter and close-marker forcer.

    Call `forced_token()` before sampling each token: an id means emit that token instead of sampling.
    Call `observe(token_id)` on every emitted token, forced ones included."""

    def __init__(self, tokenizer: Tokenizer, family: str, cap: int | None, *, starts_in_reasoning: bool) -> None:
        if family not in FAMILIES:
            raise InputError(f"chat family must be k3 or k2, got {family!r}")
        if cap is not None and cap < 0:
            raise InputError(f"reasoning cap must be >= 0, got {cap}")
        self.tok = tokenizer
        self.family = family
        self.cap = cap
        self.in_reasoning = starts_in_reasoning
        self._committed = 0  # reasoning tokens outside any unfinished tag
        self._queue: list[int] = []
        self._tag: list[int] | None = None  # K3: tokens of the tag being written, from its <|open|> / <|close|>
        self._tag_in_reasoning = False
        if family == "k3":
            self._open, self._close, self._sep = (tokenizer.encode_special(m) for m in (OPEN, CLOSE, SEP))
            self._after_close = [self._open, *tokenizer.encode("response"), self._sep]
        else:
            self._think, self._end_think, self._calls_begin = (
                tokenizer.encode_special(m) for m in (THINK, END_THINK, CALLS_BEGIN)
            )

    @property
    def reasoning_tokens(self) -> int:
        """Reasoning tokens so far; a close tag still being written counts once it is not `think`'s."""
        if self._tag is not None and self._tag_in_reasoning and not self._tag_may_close_think():
            return self._committed + len(self._tag)
        return self._committed

    def forced_token(self) -> int | None:
        """The token the runtime must emit next instead of sampling, or None."""
        pending = len(self._tag) if self._tag is not None and self._tag_in_reasoning else 0
        if not self._queue and self.in_reasoning and self.cap is not None and self._committed + pending >= self.cap:
            self._queue = self._close_marker()
        return self._queue[0] if self._queue else None

    def may_force_next(self) -> bool:
        """Whether `forced_token()` may give an id after one more token is observed, whatever that token is (the
        scheduler plans a step ahead only when not): a close marker is being forced, or the reasoning count,
        which one token raises by at most one plus the tag being written, may reach the cap."""
        if self._queue:
            return True
        if self.cap is None:
            return False
        return self._committed + (len(self._tag) if self._tag is not None else 0) + 1 >= self.cap

    def observe(self, token_id: int) -> None:
        """Account for one emitted token (sampled or forced)."""
        token_id = int(token_id)
        if self._queue:
            if token_id == self._queue[0]:
                self._queue.pop(0)
            else:  # the runtime emitted something else: recompute from the new state when asked
                self._queue = []
        if self.family == "k3":
            self._observe_k3(token_id)
        elif token_id == self._think:
            self.in_reasoning = True
        elif token_id in (self._end_think, self._calls_begin):
            self.in_reasoning = False
        elif self.in_reasoning:
            self._committed += 1

    def _observe_k3(self, t: int) -> None:
        """Tags are `<|open|>`/`<|close|>` NAME `<|sep|>`; a tag's tokens count as reasoning once it
        turns out not to be the think close tag (a new tag abandons an unfinished one)."""
        if t in (self._open, self._close):
            self._settle_tag()
            self._tag, self._tag_in_reasoning = [t], self.in_reasoning
            return
        if self._tag is None:
            self._committed += self.in_reasoning
            return
        self._tag.append(t)
        if t != self._sep:
            return
        is_think = self.tok.decode(self._tag[1:-1]) == "think"
        if is_think and self._tag[0] == self._close and self.in_reasoning:
            self.in_reasoning = False  # the close tag is a marker, not reasoning
            self._tag = None
        elif is_think and self._tag[0] == self._open and not self.in_reasoning:
            self.in_reasoning = True
            self._tag = None
        else:
            self._settle_tag()

    def _settle_tag(self) -> None:
        """The pending tag is not a think marker: its tokens are reasoning if it began in reasoning."""
        if self._tag is not None and self._tag_in_reasoning:
            self._committed += len(self._tag)
        self._tag = None

    def _tag_may_close_think(self) -> bool:
        return self._tag[0] == self._close and "think".startswith(self.tok.decode(self._tag[1:]))

    def _close_marker(self) -> list[int]:
        """The rest of the close marker: completes a `<|close|>th...` the model began, else the whole."""
        if self.family == "k2":
            return [self._end_think]
        if self._tag is not None and self._tag_may_close_think():
            rest = "think"[len(self.tok.decode(self._tag[1:])):]
            return [*self.tok.encode(rest), self._sep, *self._after_close]
        return [self._close, *self.tok.encode("think"), self._sep, *self._after_close]

"""Next-token sampling: greedy, or temperature -> top-k -> top-p with a seeded torch.Generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_export.export.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax; top_k / top_p ignored). top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_flags(
        cls, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None, seed: int = 0
    ) -> SamplingParams:
        """Command-line semantics: greedy unless a sampling flag is given; top-k / top-p alone sample at temperature 1."""
        if temperature is None:
            temperature = 1.0 if top_k is not None or top_p is not None else 0.0
        return cls(temperature, top_k or 0, 1.0 if top_p is None else top_p, seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> temperature-scaled fp32 logits with tokens outside top-k / top-p set to -inf.

    top-k keeps every token tied with the k-th largest; top-p keeps the smallest prefix of the sorted
    distribution whose probability reaches top_p (always at least the most likely token)."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return x


class Sampler:
    """Stateful sampler: one seeded generator, so a run with the same seed draws the same tokens."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(filter_logits(logits, self.params), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

"""Per-request sampling: parameters, logits processors, and a seeded sampler.

Greedy, or temperature -> top-k -> top-p with one seeded torch.Generator per request, so a request
draws the same tokens whether it runs alone or in a batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_export.export.errors import InputError

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""(output token ids so far, logits [vocab] fp32) -> logits [vocab]; applied on rank 0 before sampling
(grammar-constrained decoding plugs in here)."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings.

    temperature 0 means greedy (argmax; top_k / top_p ignored); top_k 0 and top_p 1.0 disable those filters.
    max_tokens: most tokens generated (the stop token included). stop: strings that end generation (the
    text is cut before the first one; the tokens stay in output_ids). stop_token_ids: extra ids that end
    generation besides the model's eos ids (those are ignored when `ignore_eos`). logprobs: report the
    log-probability of every chosen token (fp32 log-softmax of the processed logits, before temperature).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InputError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @classmethod
    def from_flags(
        cls, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
        max_tokens: int = 256,
    ) -> SamplingParams:
        """Command-line semantics: greedy unless a sampling flag is given; top-k / top-p alone sample at temperature 1."""
        if temperature is None:
            temperature = 1.0 if top_k is not None or top_p is not None else 0.0
        return cls(temperature, top_k or 0, 1.0 if top_p is None else top_p, seed, max_tokens)

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


class RequestSampler:
    """One request's next-token choice: logits processors, then its seeded Sampler; logprob on request."""

    def __init__(self, params: SamplingParams, processors: list[LogitsProcessor] | None = None) -> None:
        self.params = params
        self.processors = list(processors or ())
        self.sampler = Sampler(params)

    def process(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits [V] fp32 -> logits [V] after every processor, in order."""
        for proc in self.processors:
            logits = proc(output_ids, logits)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 1:
                raise InputError("a logits processor must return a 1-D tensor of logits [vocab]")
        return logits

    def choose(self, output_ids: list[int], logits: torch.Tensor, forced: int | None = None) -> tuple[int, float | None]:
        """(token id, its logprob or None) for logits [V]; `forced` (a budget's close marker) skips sampling."""
        logits = self.process(output_ids, logits.float())
        if forced is not None:
            token = forced
        else:
            token = int(self.sampler(logits[None])[0])
            if not math.isfinite(float(logits[token])):
                raise InputError("the logits processors masked every token: nothing can be sampled")
        logprob = float(torch.log_softmax(logits, dim=-1)[token]) if self.params.logprobs else None
        return token, logprob

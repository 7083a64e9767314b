"""Per-request sampling parameters and the logits processor type. The tokens are chosen inside the model
runner, for the whole batch at once (`runtime.engine.sampler`); the engine core turns these parameters into
the runner's per-row tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from moe_export.common.errors import InputError

MAX_TOP_LOGPROBS = 20

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""(output token ids so far, logits [vocab] fp32) -> logits [vocab]; applied to the request's row on rank 0
before sampling (a grammar is applied as a batched bitmask instead: `runtime.core.structured`)."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings.

    temperature 0 means greedy (argmax; top_k / top_p / min_p ignored); top_k 0, top_p 1.0 and min_p 0 disable
    those filters (kept: the top_k most likely tokens, then the smallest set of most likely ones holding top_p
    of that mass, then those at least min_p times as likely as the most likely one). seed: an unsigned 64-bit
    integer; the request's draws are a function of the seed and the token's index alone (the same alone or in
    any batch); None draws a random seed. max_tokens: most tokens generated (the stop token included); min_tokens: the eos /
    stop ids are banned before that many. stop: strings that end generation (the text is cut before the
    first one; the tokens stay in output_ids). stop_token_ids: extra ids that end generation besides the
    model's eos ids (those are ignored when `ignore_eos`). logprobs: report the log-probability of every
    chosen token (fp32 log-softmax of the processed logits, before temperature), and top_logprobs (0..20) of
    the most likely alternatives. repetition_penalty (> 0; 1 off) divides the positive logits of every
    token seen in the prompt or output and multiplies the negative ones; presence_penalty and
    frequency_penalty subtract from the logits of output tokens once, and once per occurrence (OpenAI's
    semantics); logit_bias: {token id: value added to its logit}.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 64):
            raise InputError(f"seed must be an unsigned 64-bit integer (0 to 2^64 - 1) or None, got {self.seed!r}")
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InputError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(v)) for t, v in bias))
        except (TypeError, ValueError):
            raise InputError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if any(t < 0 or not math.isfinite(v) for t, v in bias):
            raise InputError("logit_bias: token ids must be >= 0 and biases finite numbers")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @classmethod
    def from_flags(
        cls, defaults: SamplingParams, temperature: float | None = None, top_k: int | None = None,
        top_p: float | None = None, seed: int | None = None, max_tokens: int = 256,
    ) -> SamplingParams:
        """Command-line sampling: the engine's defaults (`LLM.default_sampling`: generation_config.json, else greedy)
        with the flags given on top; top-k / top-p given over greedy defaults sample at temperature 1."""
        if temperature is None and defaults.greedy and (top_k is not None or top_p is not None):
            temperature = 1.0
        return replace(defaults, **{k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                                      ("seed", seed), ("max_tokens", max_tokens)) if v is not None})

    @property
    def longest_stop(self) -> int:
        """Characters of the longest stop string (0 without stop strings)."""
        return max(map(len, self.stop), default=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def model_defaults(generation_config: dict | None) -> SamplingParams:
    """The engine's one set of sampling defaults: temperature, top_p, top_k, min_p and repetition_penalty where the
    model's generation_config.json gives them (HF names; `do_sample: false` means greedy), SamplingParams' own
    otherwise. Entry points start a request's parameters from these."""
    cfg = generation_config or {}
    given = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                      ("repetition_penalty", float)):
        if cfg.get(key) is not None:
            try:
                given[key] = kind(cfg[key])
            except (TypeError, ValueError):
                raise InputError(f"generation_config.json: {key} must be a number, got {cfg[key]!r}") from None
    if cfg.get("do_sample") is False:
        given["temperature"] = 0.0
    return SamplingParams(**given)


def with_defaults(defaults: SamplingParams, **given) -> SamplingParams:
    """A request's parameters: `given` where it is not None, else the engine's defaults (`LLM.default_sampling`);
    what every entry point (server, Triton, batch, eval) builds its requests' SamplingParams with."""
    return replace(defaults, **{k: v for k, v in given.items() if v is not None})

"""Per-request sampling parameters and the logits processor type. The tokens are chosen inside the model
runner, for the whole batch at once (`runtime.engine.sampler`).

One shape from the request to the batch: a field declared with `per_row` is a column of the runner's
`SamplingBatch` under the same name (`ROW_COLUMNS`; the core packs it, `runtime.core.rows`), and every field is a
request option of the one request parser (`runtime.request_options`). Adding a sampling field: declare it here
(default, range check), use it in `runtime/engine/sampler.py`, and, for the OpenAI / Anthropic routes, add it to
the request bodies (`runtime/entrypoints/server/protocol.py`): three files.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter

import numpy as np
import torch
from moe_export.common.errors import InputError

MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 1.1754944e-38, the smallest normal float32


class SamplingValueError(InputError):
    """A sampling value out of its range; `field`: the parameter's name (the server's 400 names it)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


def _int64(name: str, value) -> int:
    """`value` as an int within int64 (the runner's tensors); SamplingValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingValueError(name, f"must be an integer, got {value!r}")
    if not INT64_MIN <= int(value) <= INT64_MAX:
        raise SamplingValueError(name, f"must be within the 64-bit integer range (|value| < 2^63), got {value}")
    return int(value)


def _float32(name: str, value) -> float:
    """`value` as a float, finite and within float32's range; SamplingValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingValueError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise SamplingValueError(name, f"must be a finite number within float32's range (|value| <= "
                                       f"{FLOAT32_MAX:.4g}), got {value}")
    return float(value)


def per_row(default, dtype: torch.dtype, off=None):
    """A SamplingParams field that the runner reads per row: `SamplingBatch` gets a column of this name, [R] of
    `dtype`. off: the value that disables it; a step whose rows all hold it gets None instead of the column (the
    sampler skips it). Without `off` the column is always there."""
    return field(default=default, metadata={"column": dtype, "off": off})


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

    temperature: float = per_row(0.0, torch.float32)
    top_k: int = per_row(0, torch.long)
    top_p: float = per_row(1.0, torch.float32)
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = per_row(0.0, torch.float32)
    min_tokens: int = 0
    repetition_penalty: float = per_row(1.0, torch.float32, off=1.0)
    presence_penalty: float = per_row(0.0, torch.float32, off=0.0)
    frequency_penalty: float = per_row(0.0, torch.float32, off=0.0)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        """The one validation of sampling values (every entry point builds its requests' SamplingParams): each
        `int` field within int64 (the runner's tensors), each `float` field finite and within float32's range (the
        runner's sampling tensors are float32); a bad value raises `SamplingValueError` naming the field. top_p
        below float32's smallest normal number is raised to it (the top-p set is the most likely token either way)."""
        for kind, check in (("int", _int64), ("float", _float32)):  # by annotation: a new field is checked too
            for f in fields(self):
                if f.type == kind:
                    object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        if self.temperature < 0:
            raise SamplingValueError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingValueError("top_k", f"must be >= 0 (0 disables it; above the vocabulary keeps every token), "
                                              f"got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingValueError("top_p", f"must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "top_p", max(self.top_p, FLOAT32_TINY))
        if not 0 <= self.min_p <= 1:
            raise SamplingValueError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 64):
            raise SamplingValueError("seed", f"must be an unsigned 64-bit integer (0 to 2^64 - 1) or None, "
                                             f"got {self.seed!r}")
        if self.max_tokens < 1:
            raise SamplingValueError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingValueError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingValueError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not FLOAT32_TINY <= self.repetition_penalty:
            raise SamplingValueError("repetition_penalty", f"must be a number > 0 (at least float32's smallest "
                                                           f"normal, {FLOAT32_TINY:.3g}), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingValueError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingValueError("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        try:
            stop_ids = tuple(_int64("stop_token_ids", t) for t in self.stop_token_ids)
        except TypeError:
            raise SamplingValueError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}") from None
        if any(t < 0 for t in stop_ids):
            raise SamplingValueError("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((_int64("logit_bias", int(t) if isinstance(t, str) else t),
                                 _float32("logit_bias", float(v) if isinstance(v, str) else v)) for t, v in bias))
        except (TypeError, ValueError):
            raise SamplingValueError("logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}") from None
        if any(t < 0 for t, _ in bias):
            raise SamplingValueError("logit_bias", "token ids must be >= 0")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", stop_ids)

    def top_k_over(self, vocab: int | None) -> int:
        """The top-k filter a runner applies over `vocab` logits: 0 (none) when top_k keeps them all (top_k >=
        vocab: the top-k set of the whole vocabulary is the vocabulary)."""
        return 0 if vocab is not None and self.top_k >= vocab else self.top_k

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

    def row_values(self, vocab: int | None) -> tuple:
        """This request's value of each of `ROW_COLUMNS`, in their order (top_k as `top_k_over(vocab)`)."""
        values = _row_values(self)
        if vocab is not None and self.top_k >= vocab:
            return values[:_TOP_K] + (0,) + values[_TOP_K + 1:]
        return values

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


ROW_COLUMNS: dict[str, tuple[torch.dtype, object]] = {
    f.name: (f.metadata["column"], f.metadata["off"]) for f in fields(SamplingParams) if "column" in f.metadata}
"""The SamplingParams fields declared `per_row`: name -> (the batch column's dtype, the value that disables it)."""
_row_values = attrgetter(*ROW_COLUMNS)  # (one C call per row: the core builds a row per sampled sequence and step)
_TOP_K = list(ROW_COLUMNS).index("top_k")


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

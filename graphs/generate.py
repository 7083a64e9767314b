"""Autoregressive generation with the reference model: one prefill, then one decode step per token."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_export.export.errors import InputError
from moe_export.graphs.model import KimiModel
from moe_export.runtime.sampling import Sampler, SamplingParams


def generate(
    model: KimiModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_at_eos: bool = True,
) -> list[int]:
    """New token ids for one prompt (greedy by default). Stops after `max_new_tokens`, or after emitting
    the config's eos_token_id when `stop_at_eos` (the eos token is included in the result)."""
    if not prompt_ids:
        raise InputError("the prompt must contain at least one token")
    sampler = Sampler(sampling or SamplingParams())
    eos = model.cfg.eos_token_id if stop_at_eos else None
    cache = model.new_cache(1)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    logits = model.prefill(torch.tensor([prompt_ids], dtype=torch.long), cache)[:, -1]
    while True:
        token = int(sampler(logits)[0])
        out.append(token)
        if len(out) == max_new_tokens or token == eos:
            return out
        logits = model.decode(torch.tensor([token], dtype=torch.long), cache)


def parse_prompt_ids(text: str, vocab_size: int) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; InputError for an empty list, a non-integer or an id outside [0, vocab_size)."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            raise InputError(f"--prompt-ids: {part.strip()!r} is not an integer token id (expected e.g. 1,2,3)") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"--prompt-ids: token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    return ids


def resolve_prompt(
    tokenizer_dir: str | Path, prompt_ids: str | None, prompt: str | None, vocab_size: int, max_new_tokens: int
) -> list[int]:
    """Prompt token ids from exactly one of `prompt_ids` ('1,2,3') or `prompt` (text, tokenized with the
    tokenizer.json in `tokenizer_dir`)."""
    from moe_export.runtime.tokenizer import load_tokenizer

    if (prompt_ids is None) == (prompt is None):
        raise InputError("give exactly one of --prompt-ids or --prompt")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt is not None:
        ids = load_tokenizer(tokenizer_dir).encode(prompt)
        if not ids:
            raise InputError("--prompt: the text encodes to no tokens")
        return ids
    return parse_prompt_ids(prompt_ids, vocab_size)


def generate_from_checkpoint(
    path: str | Path,
    prompt_ids: str | None,
    prompt: str | None,
    max_new_tokens: int,
    sampling: SamplingParams,
) -> list[int]:
    """`moe-export generate` on an HF checkpoint directory; returns the new token ids."""
    from moe_export.graphs.config import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    ids = resolve_prompt(path, prompt_ids, prompt, cfg.vocab_size, max_new_tokens)
    return generate(KimiModel.from_checkpoint(path), ids, max_new_tokens, sampling)

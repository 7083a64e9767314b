"""`moe-export generate`: token-level generation through the runtime's scheduler (the one generation
loop), on a built engine (in process, or one rank per process under mpiexec) or on the fp32 PyTorch
reference model of a checkpoint, which `runtime.engine.reference.ReferenceEngine` puts behind the same step
interface.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe_export.export.checkpoint import load_model
from moe_export.common.errors import InputError, RequestFailed
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.reference import ReferenceEngine
from moe_export.runtime.sampling import SamplingParams


def model_eos_ids(model_config: dict) -> list[int]:
    """The stop ids of an HF config dict: `eos_token_ids` when present, else `eos_token_id` (int or list)."""
    text = model_config.get("text_config") or {}
    for key in ("eos_token_ids", "eos_token_id"):
        value = model_config.get(key, text.get(key))
        if value is not None:
            return [int(v) for v in value] if isinstance(value, list) else [int(value)]
    return []


def engine_eos_ids(engine) -> list[int]:
    """Every stop id of an engine: the build's `eos_token_ids` (config.json and generation_config.json
    together), else those of its HF config."""
    return list((engine.config.eos_token_ids if engine.config is not None else ()) or model_eos_ids(engine.model_config))


def generate_tokens(engine, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    eos_token_ids=(), sample_vocab: int | None = None) -> list[int]:
    """New token ids of one prompt (rank 0 of `engine`), through the scheduler; the stop token is included."""
    from moe_export.runtime.core.wide_ep import open_scheduler

    sched = open_scheduler(engine, eos_token_ids=eos_token_ids, keep_sessions=False, sample_vocab=sample_vocab)
    sched.add(Request("generate", list(prompt_ids), sampling or SamplingParams()))
    out: list[int] = []
    while sched.has_work:
        for update in sched.step():
            out.extend(update.token_ids)
            if update.error:
                raise RequestFailed(f"request generate failed in the engine: {update.error}")
    return out


def reference_generate(model, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                       stop_at_eos: bool = True) -> list[int]:
    """Generation with the reference model (greedy by default): at most `max_new_tokens`, stopping after
    any of the config's eos ids when `stop_at_eos` (the eos token is included)."""
    if max_new_tokens < 1:
        return []
    base = sampling or SamplingParams()
    params = dataclasses.replace(base, max_tokens=max_new_tokens, ignore_eos=not stop_at_eos)
    eos = list(model.cfg.eos_token_ids)
    engine = ReferenceEngine(model, max_seq_len=len(prompt_ids) + max_new_tokens)
    return generate_tokens(engine, prompt_ids, params, eos)


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
    tokenizer in `tokenizer_dir`)."""
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


def generate_command(path: str | Path, prompt_ids: str | None, prompt: str | None, sampling: SamplingParams
                     ) -> list[int] | None:
    """`moe-export generate` on an engine directory or an HF checkpoint: the new token ids (None on
    non-root ranks under mpiexec, which follow rank 0's steps)."""
    from moe_export.common.engine_config import is_engine_config
    from moe_export.common.model_config import ModelConfig

    if is_engine_config(path):
        from moe_export.runtime.core.wide_ep import release_ranks, run_rank
        from moe_export.runtime.engine import open_engine

        engine = open_engine(path, num_slots=1)
        if not engine.is_root:
            run_rank(engine, keep_sessions=False)  # dp layout: a group leader runs its (empty) group's steps
            return None
        try:
            ids = resolve_prompt(path, prompt_ids, prompt, engine.config.model.vocab_size, sampling.max_tokens)
            return generate_tokens(engine, ids, sampling, engine_eos_ids(engine))
        finally:
            if engine.comm is not None:
                release_ranks(engine)  # also after an error
    from moe_export.export.planner import check_reference_fits

    cfg = ModelConfig.from_pretrained(path)
    check_reference_fits(cfg, str(path))  # before reading any weights
    ids = resolve_prompt(path, prompt_ids, prompt, cfg.vocab_size, sampling.max_tokens)
    engine = ReferenceEngine(load_model(path), max_seq_len=len(ids) + sampling.max_tokens)
    return generate_tokens(engine, ids, sampling, cfg.eos_token_ids)

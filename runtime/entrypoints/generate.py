"""`moe-export generate`: token-level generation through the runtime's scheduler (the one generation
loop), on a built engine (in process, or one rank per process under mpiexec) or on the fp32 PyTorch
reference model of a checkpoint, which `runtime.engine.reference.ReferenceEngine` puts behind the same step
interface.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe_export.export.convert.checkpoint import load_model
from moe_export.common.errors import InputError, RequestFailed
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.reference import ReferenceEngine
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.tokenizer import has_tokenizer, load_tokenizer


def generate_tokens(engine, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    eos_token_ids=(), sample_vocab: int | None = None) -> list[int]:
    """New token ids of one prompt (rank 0 of `engine`), through the scheduler; the stop token is included."""
    from moe_export.runtime.core.wide_ep import open_engine_core

    sched = open_engine_core(engine, eos_token_ids=eos_token_ids, keep_sessions=False, sample_vocab=sample_vocab)
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
    """Prompt token ids from exactly one of `prompt_ids` ('1,2,3': ids the model and, when the folder has one, its
    tokenizer both know, as the server accepts) or `prompt` (text, tokenized with the tokenizer in
    `tokenizer_dir`)."""
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
    try:
        vocab_size = min(vocab_size, load_tokenizer(tokenizer_dir).vocab_size)
    except InputError:  # a checkpoint without a tokenizer: the model's vocabulary alone
        pass
    return parse_prompt_ids(prompt_ids, vocab_size)


def generate_command(path: str | Path, prompt_ids: str | None, prompt: str | None, flags: dict) -> list[int] | None:
    """`moe-export generate` on an engine directory or an HF checkpoint: the new token ids (None on non-root ranks under
    mpiexec, which follow rank 0's steps). `flags`: SamplingParams.from_flags' keywords (temperature, top_k, top_p,
    seed, max_tokens) over the defaults of the model's generation_config.json. An engine runs through `LLM`, as every
    entry point does (its stop ids, its defaults); a checkpoint through the fp32 reference model."""
    from moe_export.common.engine_config import is_engine_config
    from moe_export.common.model_config import ModelConfig, read_generation_config
    from moe_export.runtime.sampling import model_defaults

    if is_engine_config(path):
        from moe_export.runtime.client.llm import LLM

        # token ids need no tokenizer: an engine built from a checkpoint without tokenizer files generates from them
        llm = LLM(path, num_slots=1, reuse_sessions=False, skip_tokenizer_init=prompt is None and not has_tokenizer(path))
        if not llm.engine.is_root:
            llm.run_follower()
            return None
        try:
            sampling = SamplingParams.from_flags(llm.default_sampling, **flags)
            ids = resolve_prompt(path, prompt_ids, prompt, llm.engine.config.model.vocab_size, sampling.max_tokens)
            return llm.generate([ids], sampling)[0].output_ids
        finally:
            llm.shutdown()  # also after an error: the follower ranks are released
    from moe_export.export.plan.planner import check_reference_fits

    cfg = ModelConfig.from_pretrained(path)
    check_reference_fits(cfg, str(path))  # before reading any weights
    sampling = SamplingParams.from_flags(model_defaults(read_generation_config(path)), **flags)
    ids = resolve_prompt(path, prompt_ids, prompt, cfg.vocab_size, sampling.max_tokens)
    eos, vocab = list(cfg.eos_token_ids), None
    try:  # as LLM on an engine: the tokenizer's stop ids too, and only ids it can decode are sampled
        tokenizer = load_tokenizer(path)
        eos, vocab = sorted(set(eos) | set(tokenizer.eos_token_ids)), tokenizer.vocab_size
    except InputError:  # a checkpoint without a tokenizer: the model's own
        pass
    engine = ReferenceEngine(load_model(path), max_seq_len=len(ids) + sampling.max_tokens)
    return generate_tokens(engine, ids, sampling, eos, sample_vocab=vocab)

"""Generation with a built engine: chunked prefill, then one decode step per token.

Under mpiexec every rank runs this loop in lockstep; rank 0 samples and broadcasts each token so
all ranks feed the same ids.
"""

from __future__ import annotations

import torch

from pathlib import Path

from moe_export.export.errors import InputError
from moe_export.runtime.engine import Engine, SequenceChunk, StepBatch
from moe_export.runtime.sampling import Sampler, SamplingParams


def engine_generate(
    engine: Engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | None = None,
    slot: int = 0,
    max_chunk: int | None = None,
    block_table: list[int] | None = None,
) -> list[int]:
    """New token ids for one prompt (greedy by default); includes eos if emitted.

    block_table: cache blocks of the sequence (enough for prompt + max_new_tokens); default: the first
    blocks of the pool (this loop runs one sequence at a time)."""
    if not prompt_ids:
        raise InputError("the prompt must contain at least one token")
    if len(prompt_ids) + max_new_tokens > engine.max_seq_len:
        raise InputError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
            f"max_seq_len {engine.max_seq_len}"
        )
    if block_table is None:
        block_table = list(range(-(-(len(prompt_ids) + max_new_tokens) // engine.block_size)))
    sampler = Sampler(sampling or SamplingParams())
    chunk = max_chunk or engine.max_num_tokens
    engine.reset_slot(slot)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    logits = None
    for start in range(0, len(prompt_ids), chunk):
        logits = engine.step(StepBatch.from_sequences([SequenceChunk(slot, start, prompt_ids[start:start + chunk], block_table)]))
    pos = len(prompt_ids)
    while True:
        token = int(sampler(torch.from_numpy(logits))[0]) if engine.is_root else None
        if engine.comm is not None:
            token = engine.comm.broadcast(token)
        out.append(token)
        if len(out) == max_new_tokens or token == eos_token_id:
            return out
        logits = engine.step(StepBatch.from_sequences([SequenceChunk(slot, pos, [token], block_table)]))
        pos += 1


def generate_from_engine(
    path: str | Path, prompt_ids: str | None, prompt: str | None, max_new_tokens: int, sampling: SamplingParams
) -> tuple[list[int], Engine]:
    """`moe-export generate` on a built engine directory (in process, or one rank under mpiexec)."""
    from moe_export.graphs.config import ModelConfig
    from moe_export.graphs.generate import resolve_prompt

    engine = Engine(path)
    cfg = ModelConfig.from_hf_dict(engine.model_config, source=f"{path}/config.json")
    ids = resolve_prompt(path, prompt_ids, prompt, cfg.vocab_size, max_new_tokens)
    return engine_generate(engine, ids, max_new_tokens, sampling, cfg.eos_token_id), engine

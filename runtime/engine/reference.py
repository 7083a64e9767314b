"""The fp32 PyTorch reference model behind the runners' step interface (`moe-export generate` on a checkpoint,
and the oracle of the runners' tests)."""

from __future__ import annotations

import copy

import numpy as np
import torch

from moe_export.common.recipe import LimitsSection
from moe_export.runtime.engine.batch import StepBatch, check_blocks, check_checkpoint, check_slot, check_step_batch
from moe_export.runtime.engine.runner import choose_tokens
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch


class ReferenceEngine:
    """The reference KimiModel behind the Engine step interface: one ModelCache per slot. Block tables
    are accepted and unused (each slot's reference cache grows with its sequence); a state checkpoint is a copy
    of a slot's whole cache (its attention rows included, so resuming needs no block)."""

    world_size = 1
    comm = None
    is_root = True
    max_step_pairs = None  # the reference's attention holds [T, context] scores only
    vision = None  # text only
    dp_layout = False

    def __init__(self, model, *, num_slots: int = 1, max_seq_len: int = 4096, max_num_tokens: int = 8192,
                 block_size: int = 64) -> None:
        self.model = model
        self.num_slots, self.max_seq_len, self.max_num_tokens, self.block_size = num_slots, max_seq_len, max_num_tokens, block_size
        self.num_blocks = num_slots * -(-max_seq_len // block_size)
        self.model_config = {"vocab_size": model.cfg.vocab_size}
        self.config = None  # not built from an engine directory: no EngineConfig
        self.caches = [model.new_cache(1) for _ in range(num_slots)]
        self.num_checkpoints = LimitsSection().checkpoints_per_slot * num_slots  # the recipe's default
        self.checkpoint_interval = -(-max_num_tokens // block_size) * block_size
        self.checkpoints: dict[int, object] = {}

    def reset_slot(self, slot: int) -> None:
        check_slot(self, slot)
        self.caches[slot] = self.model.new_cache(1)

    def save_state(self, slot: int, checkpoint: int) -> None:
        check_checkpoint(self, slot, checkpoint)
        self.checkpoints[checkpoint] = copy.deepcopy(self.caches[slot])

    def restore_state(self, slot: int, checkpoint: int) -> None:
        check_checkpoint(self, slot, checkpoint)
        self.caches[slot] = copy.deepcopy(self.checkpoints[checkpoint])

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        """`ModelRunner.read_blocks`: no cache pools (a slot's attention rows live in its own cache, and a checkpoint
        copies them whole): no rows, so a block copy (`StepPlan.copies`) changes nothing."""
        check_blocks(self, blocks)
        return {}

    def write_blocks(self, blocks: list[int], rows: dict[str, np.ndarray]) -> None:
        """`ModelRunner.write_blocks` of `read_blocks`' (empty) rows: nothing to write."""
        check_blocks(self, blocks)

    def step(self, batch: StepBatch) -> np.ndarray:
        """logits [N, vocab] fp32 of each sequence's last token; each chunk continues its slot's cache."""
        check_step_batch(self, batch)
        rows = []
        for n, slot in enumerate(batch.slot_ids.tolist()):
            lo, hi = int(batch.cu_seqlens[n]), int(batch.cu_seqlens[n + 1])
            cache = self.caches[slot]
            if int(batch.positions[lo]) != cache.length:
                raise ValueError(f"slot {slot} holds {cache.length} tokens; the chunk starts at {int(batch.positions[lo])}")
            ids = torch.from_numpy(batch.input_ids[lo:hi]).long()[None]
            rows.append(self.model(ids, cache)[0, -1])
        return torch.stack(rows).numpy()

    def sample(self, batch: StepBatch | None, sampling: SamplingBatch | None) -> SampledTokens | None:
        """`ModelRunner.sample`: one step, then the batched sampler on the logits."""
        logits = self.step(batch)
        return None if sampling is None else choose_tokens(torch.from_numpy(logits), sampling)

"""A step batch, the runners' common input: sequence chunks packed into one step, and the one validation
of a step against a runner's limits (every runner calls `check_step_batch` before it runs a step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from moe_export.common.errors import InputError
from moe_export.plugins.paged_cache_write.cpu import cache_rows

STATE_PREFIXES = ("kda_state.", "conv_state.", "mla_cache.", "index_cache.")
RESET_ON_NEW_SEQUENCE = ("kda_state.", "conv_state.")  # recurrent state, by slot; the other pools are paged caches


@dataclass
class SequenceChunk:
    """One sequence's tokens in a step.

    slot: recurrent-state slot (KDA state + conv windows) of the sequence; start: absolute position of
    tokens[0]; tokens: the new token ids (at least one); block_table: physical cache block ids covering
    positions [0, start + len(tokens)) in order (block j holds positions j*block_size .. (j+1)*block_size-1).
    """

    slot: int
    start: int
    tokens: list[int]
    block_table: list[int] | np.ndarray  # [B] int64 array or list (an array is copied with one memcpy)
    image_rows: list[int] = field(default_factory=list)  # indices into `tokens` that take image embeddings
    image_embeds: np.ndarray | None = None  # [len(image_rows), hidden] fp32, in that order


@dataclass
class StepBatch:
    """One engine step over N sequences: tokens [T] packed in sequence order; with a vision tower, the rows of
    the step's `<|media_pad|>` tokens (`image_rows` [M]) and the image embeddings that replace their input
    embeddings (`image_embeds` [M, hidden])."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    cu_seqlens: np.ndarray  # [N+1] int64
    slot_ids: np.ndarray  # [N] int64
    block_tables: np.ndarray  # [N, B] int64, B = longest table in the step, rows padded with -1
    image_rows: np.ndarray | None = None  # [M] int64
    image_embeds: np.ndarray | None = None  # [M, hidden] fp32

    @classmethod
    def from_sequences(cls, chunks: list[SequenceChunk], image_width: int | None = None) -> StepBatch:
        """Pack `chunks` (each with at least one token) into one step; `image_width` (the hidden size of an
        engine with a vision tower) adds the image inputs, empty when no chunk has image rows."""
        if not chunks:
            raise InputError("a step needs at least one sequence chunk")
        ids, pos, cu = [], [], [0]
        for c in chunks:
            if not isinstance(c, SequenceChunk):
                raise InputError(f"StepBatch.from_sequences takes SequenceChunk items, got {type(c).__name__}")
            if not c.tokens:
                raise InputError(f"sequence chunk of slot {c.slot} has no tokens")
            ids.extend(c.tokens)
            pos.extend(range(c.start, c.start + len(c.tokens)))
            cu.append(cu[-1] + len(c.tokens))
        width = max(len(c.block_table) for c in chunks)
        tables = np.full((len(chunks), max(width, 1)), -1, dtype=np.int64)
        for n, c in enumerate(chunks):
            tables[n, : len(c.block_table)] = c.block_table
        ids, pos, cu = (np.asarray(v, dtype=np.int64) for v in (ids, pos, cu))
        batch = cls(ids, pos, cu, np.asarray([c.slot for c in chunks], dtype=np.int64), tables)
        if any(c.image_rows for c in chunks) and image_width is None:
            raise InputError("image embeddings in a step of an engine without a vision tower")
        if image_width is not None:
            rows = [cu[n] + r for n, c in enumerate(chunks) for r in c.image_rows]
            embeds = [c.image_embeds for c in chunks if c.image_rows]
            batch.image_rows = np.asarray(rows, dtype=np.int64)
            batch.image_embeds = (np.concatenate(embeds).astype(np.float32) if embeds
                                  else np.zeros((0, image_width), dtype=np.float32))
            if batch.image_embeds.shape != (len(rows), image_width):
                raise InputError(f"image embeddings of shape {batch.image_embeds.shape} for {len(rows)} image rows "
                                 f"of width {image_width}")
        return batch

    @property
    def num_sequences(self) -> int:
        return int(self.slot_ids.shape[0])

    def cache_rows(self, block_size: int) -> np.ndarray:
        """[T] int64 physical pool row of each token: its block-table block * block_size + offset in the block."""
        return cache_rows(*(torch.from_numpy(a) for a in (self.cu_seqlens, self.block_tables, self.positions)),
                          block_size).numpy()

    def feeds(self) -> dict[str, np.ndarray]:
        out = {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "cu_seqlens": self.cu_seqlens,
            "slot_ids": self.slot_ids,
            "block_tables": self.block_tables,
            "last_token_index": self.cu_seqlens[1:] - 1,
        }
        if self.image_rows is not None:
            out.update(image_rows=self.image_rows, image_embeds=self.image_embeds)
        return out


def check_slot(runner, slot: int) -> None:
    """InputError unless `slot` is one of the runner's recurrent-state slots."""
    if not 0 <= slot < runner.num_slots:
        raise InputError(f"slot {slot} out of range: the engine has {runner.num_slots} slots")


def check_checkpoint(runner, slot: int, checkpoint: int) -> None:
    """InputError unless `slot` is a state slot and `checkpoint` one of the runner's checkpoint pool entries."""
    check_slot(runner, slot)
    if not 0 <= checkpoint < runner.num_checkpoints:
        raise InputError(f"checkpoint {checkpoint} out of range: the engine has {runner.num_checkpoints} state checkpoints")


def check_blocks(runner, blocks: list[int]) -> None:
    """InputError unless every id of `blocks` is one of the runner's cache blocks."""
    bad = [b for b in blocks if not 0 <= b < runner.num_blocks]
    if bad:
        raise InputError(f"cache blocks {bad[:8]} out of range: the engine has {runner.num_blocks} blocks")


def checkpoint_interval(pools: dict[str, tuple[tuple[int, ...], int]], block_size: int, max_num_tokens: int) -> int:
    """Tokens between periodic recurrent-state checkpoints of a prefilling prompt, from the runner's pools
    ({name: (shape, bytes per element)}): a multiple of block_size that is at least (1) the tokens whose cache
    bytes (MLA / indexer rows) equal one checkpoint's bytes (KDA state + conv windows of a slot), so periodic
    checkpoints at most double a cached prefix's memory, and (2) max_num_tokens, since a prefill chunk ends at
    each checkpoint: at most one extra step per interval."""
    def nbytes(shape, itemsize, skip):
        return int(np.prod(shape[skip:])) * itemsize

    per_slot = sum(nbytes(s, i, 1) for n, (s, i) in pools.items() if n.startswith(RESET_ON_NEW_SEQUENCE))
    per_token = sum(nbytes(s, i, 2) for n, (s, i) in pools.items() if not n.startswith(RESET_ON_NEW_SEQUENCE))
    tokens = max(-(-per_slot // max(per_token, 1)), max_num_tokens, 1)
    return -(-tokens // block_size) * block_size


def check_step_batch(runner, batch: StepBatch) -> None:
    """Clear errors for a step `runner`'s pools cannot hold (every runner checks its steps with this): slot,
    position or block id out of range, block table too short for the positions written, two tokens writing
    one cache row, more tokens than max_num_tokens. Vectorized: O(tokens + table entries) numpy work."""
    n_tokens, n_seq = int(batch.input_ids.shape[0]), batch.num_sequences
    if n_tokens > runner.max_num_tokens:
        raise InputError(f"step has {n_tokens} tokens; the engine's max_num_tokens is {runner.max_num_tokens}")
    slots = batch.slot_ids
    bad = (slots < 0) | (slots >= runner.num_slots)
    if bad.any():
        check_slot(runner, int(slots[bad.argmax()]))
    if np.unique(slots).shape[0] != n_seq:
        raise InputError(f"a step may hold each slot once, got slots {slots.tolist()}")
    ends = batch.positions[batch.cu_seqlens[1:] - 1] + 1
    long = ends > runner.max_seq_len
    if long.any():
        n = int(long.argmax())
        raise InputError(f"sequence in slot {int(slots[n])} reaches {int(ends[n])} tokens; the engine's "
                         f"max_seq_len is {runner.max_seq_len}")
    need = -(-ends // runner.block_size)
    tables = batch.block_tables
    within = np.arange(tables.shape[1])[None, :] < need[:, None]
    short = (need > tables.shape[1]) | ((tables < 0) & within).any(axis=1)
    if short.any():
        n = int(short.argmax())
        raise InputError(f"sequence in slot {int(slots[n])}: block table covers {int((tables[n] >= 0).sum())} "
                         f"blocks, {int(need[n])} needed for {int(ends[n])} tokens (block_size {runner.block_size})")
    over = ((tables >= runner.num_blocks) & within).any(axis=1)
    if over.any():
        n = int(over.argmax())
        raise InputError(f"sequence in slot {int(slots[n])}: block id {int(tables[n][within[n]].max())} out of "
                         f"range: the engine has {runner.num_blocks} blocks")
    rows = batch.cache_rows(runner.block_size)
    if np.unique(rows).shape[0] != rows.shape[0]:
        raise InputError("two tokens of the step would write the same cache row: block tables of the step's "
                         "sequences overlap where they write")

"""A step's sampling rows: each sampled sequence's row is built on its own (`build_row`: its parameters, forced
token, grammar bitmask, processors, penalties, bias and bans), so a row that cannot be built fails its request
only; the rows that were built are packed into the runner's `SamplingBatch` (`pack_rows`). The requests'
`per_row` values (`SamplingParams`, `ROW_COLUMNS`) go through as they are declared: no field is named here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.engine.sampler import SamplingBatch
from moe_export.runtime.sampling import ROW_COLUMNS

U64 = 1 << 64


def seed_bits(seed: int) -> int:
    """An unsigned 64-bit seed as the int64 with the same bits (the sampler hashes the bits); ValueError outside
    [0, 2^64)."""
    if not 0 <= seed < U64:
        raise ValueError(f"seed {seed} is not an unsigned 64-bit integer")
    return seed - U64 if seed >= U64 >> 1 else seed


@dataclass
class SamplingRow:
    """One sampled sequence's share of a step's `SamplingBatch` (host values; `pack_rows` makes the tensors).
    values: its request's `SamplingParams.row_values` (one per `ROW_COLUMNS`); seed (int64 bits), counter, forced,
    logprobs: its `SequenceColumns`. bitmask: its grammar's mask of the next token [W] int32 (None:
    unconstrained); processors: logits -> logits; seen: prompt + output ids (repetition penalty); output ids with
    their counts (presence / frequency)."""

    values: tuple
    seed: int
    counter: int
    forced: int
    logprobs: int
    bitmask: torch.Tensor | None = None
    processors: list = field(default_factory=list)
    seen: np.ndarray | None = None
    output_ids: np.ndarray | None = None
    output_counts: np.ndarray | None = None
    bias: list[tuple[int, float]] = field(default_factory=list)
    banned: list[int] = field(default_factory=list)
    counts: PenaltyCounts | None = None  # where `seen` comes from (its packed form is kept there across steps)


class PenaltyCounts:
    """A sequence's penalty inputs, kept up to date a token at a time: its distinct tokens (prompt and output:
    repetition) and its output tokens with their counts (presence / frequency), in first-seen order. `absorb`
    takes the tokens added since its last call, so a step costs O(new tokens), not O(context); the arrays it hands
    out are views of O(distinct tokens) (at most the vocabulary)."""

    def __init__(self) -> None:
        self.absorbed = 0  # tokens [0, absorbed) counted
        self._seen: dict[int, None] = {}
        self._seen_ids = np.empty(64, dtype=np.int64)
        self._out_slot: dict[int, int] = {}  # output token -> its index in _out_ids / _out_counts
        self._out_ids = np.empty(16, dtype=np.int64)
        self._out_counts = np.zeros(16, dtype=np.int64)
        self._row = torch.empty(0, dtype=torch.long)  # the batch row of `seen` as packed last, one per seen id
        self._row_of = -1

    def absorb(self, tokens: list[int], prompt_len: int) -> None:
        """Count tokens[absorbed:] (positions from prompt_len on are output)."""
        for pos in range(self.absorbed, len(tokens)):
            t = int(tokens[pos])
            if t not in self._seen:
                n = len(self._seen)
                if n == len(self._seen_ids):
                    self._seen_ids = np.resize(self._seen_ids, 2 * n)
                self._seen_ids[n] = t
                self._seen[t] = None
            if pos >= prompt_len:
                j = self._out_slot.get(t)
                if j is None:
                    j = self._out_slot[t] = len(self._out_slot)
                    if j == len(self._out_ids):
                        self._out_ids = np.resize(self._out_ids, 2 * j)
                        self._out_counts = np.resize(self._out_counts, 2 * j)
                    self._out_ids[j], self._out_counts[j] = t, 0
                self._out_counts[j] += 1
        self.absorbed = len(tokens)

    @property
    def seen(self) -> np.ndarray:
        return self._seen_ids[:len(self._seen)]

    def packed_seen(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [n], token [n]) of the seen ids for batch row `row`, as `SamplingBatch.seen` takes them: views of
        buffers that only grow at their ends (the row buffer is remade, doubling, when it is full or the sequence's
        batch row changes), so a step costs O(new ids) and what an earlier step was handed never changes."""
        n = len(self._seen)
        if n > len(self._row) or row != self._row_of:  # a new buffer: a step in flight may still read the old one
            self._row = torch.full((max(n, 2 * len(self._row)),), row, dtype=torch.long)
            self._row_of = row
        return self._row[:n], torch.from_numpy(self.seen)

    @property
    def output_ids(self) -> np.ndarray:
        return self._out_ids[:len(self._out_slot)]

    @property
    def output_counts(self) -> np.ndarray:
        return self._out_counts[:len(self._out_slot)]


def build_row(seq: Sequence, eos_token_ids: frozenset[int], vocab: int | None) -> SamplingRow:
    """`seq`'s sampling row for its next token over `vocab` logits (top_k at or above it: no top-k filter).
    Raises whatever its parameters, budget or grammar raise (the caller fails that request alone)."""
    req = seq.request
    p = req.sampling
    n_out = len(seq.tokens) + seq.pending - seq.prompt_len
    forced = req.budget.forced_token() if req.budget is not None else None
    row = SamplingRow(p.row_values(vocab), seed_bits(seq.seed), n_out, -1 if forced is None else int(forced),
                      p.top_logprobs if p.logprobs else -1)
    for proc in req.logits_processors:
        if hasattr(proc, "fill_bitmask"):  # a grammar: one row of the step's bitmask
            mask = torch.empty(proc.bitmask_width, dtype=torch.int32)
            if proc.fill_bitmask(seq.output_ids, mask):
                row.bitmask = mask
        else:
            row.processors.append(lambda logits, proc=proc, seq=seq: proc(seq.output_ids, logits))
    if p.penalized:
        if seq.penalties is None:
            seq.penalties = PenaltyCounts()
        counts = seq.penalties
        counts.absorb(seq.tokens, seq.prompt_len)
        if p.repetition_penalty != 1:
            row.seen, row.counts = counts.seen, counts
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            row.output_ids, row.output_counts = counts.output_ids, counts.output_counts
    row.bias = [(int(t), float(v)) for t, v in p.logit_bias]
    if n_out < p.min_tokens:
        row.banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
    return row


def pack_rows(rows: list[SamplingRow], positions: list[int], vocab: int | None) -> SamplingBatch:
    """The runner's tensors for `rows`, the sampled sequences at step positions `positions`."""
    columns = {}
    for (name, (dtype, off)), values in zip(ROW_COLUMNS.items(), zip(*(r.values for r in rows))):
        if off is None or values.count(off) != len(values):  # (a column every row has off is left out: None)
            columns[name] = torch.tensor(values, dtype=dtype)
    sb = SamplingBatch(
        rows=torch.tensor(positions, dtype=torch.long),
        seed=torch.tensor([r.seed for r in rows], dtype=torch.long),
        counter=torch.tensor([r.counter for r in rows], dtype=torch.long),
        forced=torch.tensor([r.forced for r in rows], dtype=torch.long),
        logprobs=torch.tensor([r.logprobs for r in rows], dtype=torch.long),
        vocab=vocab, processors=[(j, fn) for j, r in enumerate(rows) for fn in r.processors], **columns,
    )
    masked = [j for j, r in enumerate(rows) if r.bitmask is not None]
    if masked:
        sb.bitmask = torch.stack([rows[j].bitmask for j in masked])
        sb.bitmask_rows = torch.tensor(masked, dtype=torch.long)
    _pack_penalties(sb, rows)
    bias = [(j, t, v) for j, r in enumerate(rows) for t, v in r.bias]
    if bias:
        r, t, v = zip(*bias)
        sb.logit_bias = (torch.tensor(r), torch.tensor(t), torch.tensor(v, dtype=torch.float32))
    banned = [(j, t) for j, r in enumerate(rows) for t in r.banned]
    if banned:
        r, t = zip(*banned)
        sb.banned = (torch.tensor(r), torch.tensor(t))
    return sb


def _pack_penalties(sb: SamplingBatch, rows: list[SamplingRow]) -> None:
    """The penalties' token inputs: prompt and output tokens (repetition), output token counts (presence /
    frequency)."""
    seen = [(j, r.seen) for j, r in enumerate(rows) if r.seen is not None]
    if len(seen) == 1 and rows[seen[0][0]].counts is not None:  # one row: its packed form, kept across steps
        sb.seen = rows[seen[0][0]].counts.packed_seen(seen[0][0])
    elif seen:
        sb.seen = (torch.from_numpy(np.concatenate([np.full(ids.shape, j) for j, ids in seen])),
                   torch.from_numpy(np.concatenate([ids for _, ids in seen])))
    out = [(j, r.output_ids, r.output_counts) for j, r in enumerate(rows) if r.output_ids is not None]
    if out and sum(len(ids) for _, ids, _ in out):
        sb.output_counts = (torch.from_numpy(np.concatenate([np.full(ids.shape, j) for j, ids, _ in out])),
                            torch.from_numpy(np.concatenate([ids for _, ids, _ in out])),
                            torch.from_numpy(np.concatenate([c for _, _, c in out])).float())

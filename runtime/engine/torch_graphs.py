"""Decode steps of the torch runner on a GPU as CUDA graphs, one per batch-size bucket, captured and warmed at load.

A decode step (every sequence one token, no image rows) of N sequences replays the graph of the smallest bucket
B >= N (powers of two up to the engine's slots): the step's ids, positions and slots are copied into the bucket's
static inputs, and of its block table only the rows that changed since the bucket's last replay (the table stays on
the device; a host mirror tells which rows differ); rows N..B-1 are padding that points at a spare slot and a spare
cache block the runner allocates past its own (`TorchEngine` sizes the pools num_slots + 1 and num_blocks + 1), and
the logits come back as the first N rows of the graph's static output. Warm-up and capture touch only the spare slot
and block, so loading changes no pool a sequence can own. The graphs are captured largest bucket first into one
shared memory pool (a smaller graph reuses the larger's memory; replays never overlap). Captured where a step has
no host synchronisation: one local rank (world 1, or one rank under mpiexec; NCCL collectives are captured with
it); in the dp layout only on the device transport (`TorchEngine.device_transport`: the MoE all-to-alls in blocks
of ceil(B / tp) rows per peer), every rank replaying the bucket the world agreed on (`TorchEngine.agree_rows`),
an idle rank with every row padding. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_export.runtime.engine.batch import StepBatch
from moe_export.runtime.engine.torch_model import StepInputs

WARMUP_PREFILL_TOKENS = 16  # one eager prefill-shaped step at load compiles the prefill kernels' variants too
EAGER_STEP = 1 << 62  # the rows of a step no graph covers: the world's MAX of them makes every rank's step eager


def buckets(max_batch: int) -> list[int]:
    """Powers of two from 1 up to the first one >= max_batch."""
    out = [1]
    while out[-1] < max_batch:
        out.append(out[-1] * 2)
    return out


class DecodeGraphs:
    """The captured decode graphs of one engine (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        (self.rank,) = engine.models
        self.spare_slot, self.spare_block = engine.num_slots, engine.num_blocks
        self.width = -(-engine.max_seq_len // engine.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepInputs, torch.Tensor]] = {}
        self.tables: dict[int, np.ndarray] = {}  # each bucket's block table as its device copy holds it

    @classmethod
    def for_engine(cls, engine) -> DecodeGraphs | None:
        """Captured graphs for a CUDA engine whose steps can be captured; None otherwise."""
        if len(engine.models) != 1 or (engine.dp_layout and not engine.device_transport()):
            return None
        graphs = cls(engine)
        graphs.warm_up()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(buckets(engine.num_slots)):
            graphs.capture(size, pool)
        return graphs

    @property
    def smallest(self) -> int:
        return min(self.graphs)

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least n sequences."""
        return next(b for b in sorted(self.graphs) if b >= n)

    def _static(self, size: int, tokens: int | None = None) -> StepInputs:
        """Inputs of `size` sequences of `tokens` each (default 1) on the spare slot and block."""
        dev, t = self.engine.device, tokens or 1
        cu = torch.arange(size + 1, device=dev) * t
        tables = torch.from_numpy(self._padding_table(size)).to(dev)
        return StepInputs(torch.zeros(size * t, dtype=torch.int64, device=dev),
                          torch.arange(t, device=dev).repeat(size), cu,
                          torch.full((size,), self.spare_slot, dtype=torch.int64, device=dev), tables, cu[1:] - 1)

    def _padding_table(self, size: int) -> np.ndarray:
        """[size, width] block table of padding rows: the spare block, then -1."""
        tables = np.full((size, self.width), -1, dtype=np.int64)
        tables[:, 0] = self.spare_block
        return tables

    def _eager(self, inputs: StepInputs) -> torch.Tensor:
        e = self.engine
        step = e.models[self.rank].step(inputs, e.pools[self.rank], e.kernels[self.rank])
        if e.world is None:
            return _drain(step)
        return e.world.run(step, e.num_experts, [])

    def _begin(self, rows: int) -> None:
        """dp layout: a warm-up or capture step dispatches nothing real (`begin_moe_step`)."""
        if self.engine.dp_layout:
            self.engine.begin_moe_step(0, rows, rows)

    def warm_up(self) -> None:
        """Compile every kernel variant once: a prefill-shaped step and a decode step, on the spare slot."""
        with torch.no_grad():
            self._begin(EAGER_STEP)
            self._eager(self._static(1, min(WARMUP_PREFILL_TOKENS, self.engine.block_size)))
            self._begin(1)
            self._eager(self._static(1))
        torch.cuda.synchronize(self.engine.device)

    def capture(self, size: int, pool) -> None:
        """Capture bucket `size` into the shared memory `pool` (after one eager run on the capture stream)."""
        inputs = self._static(size)
        self._begin(size)  # on the current stream, before the side stream waits for it
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._eager(inputs)  # allocator warm-up on the capture stream
        torch.cuda.current_stream(self.engine.device).wait_stream(stream)
        self._begin(size)  # the dispatches' layer count starts again; never inside the capture (a copy would be baked)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), torch.no_grad():
            logits = self._eager(inputs)
        self.graphs[size] = (graph, inputs, logits)

    def covers(self, batch: StepBatch) -> bool:
        """A decode step (one token per sequence, no images) within the largest bucket."""
        n = batch.num_sequences
        return (batch.input_ids.shape[0] == n and n <= max(self.graphs) and batch.block_tables.shape[1] <= self.width
                and (batch.image_rows is None or batch.image_rows.shape[0] == 0))

    def replay(self, batch: StepBatch | None, size: int | None = None) -> torch.Tensor | None:
        """Logits [N, vocab] fp32 of a decode step (`covers`) from bucket `size` (default: the smallest that holds
        it; the dp layout passes the world's, and None for an idle rank: every row padding, no logits)."""
        n = 0 if batch is None else batch.num_sequences
        size = self.bucket(n) if size is None else size
        graph, inputs, logits = self.graphs[size]
        rows = np.zeros((3, size), dtype=np.int64)
        rows[2] = self.spare_slot
        table = self._padding_table(size)
        if batch is not None:
            rows[0, :n], rows[1, :n], rows[2, :n] = batch.input_ids, batch.positions, batch.slot_ids
            table[:n] = -1
            table[:n, : batch.block_tables.shape[1]] = batch.block_tables
        mirror = self.tables.setdefault(size, self._padding_table(size))  # as `_static` made it
        changed = np.flatnonzero((table != mirror).any(axis=1))
        mirror[changed] = table[changed]
        host = torch.from_numpy(np.concatenate([rows.ravel(), changed, table[changed].ravel()]))
        device = self.engine.device
        staged = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        inputs.ids.copy_(staged[:size])
        inputs.positions.copy_(staged[size:2 * size])
        inputs.slots.copy_(staged[2 * size:3 * size])
        if changed.size:
            k = changed.size
            inputs.tables.index_copy_(0, staged[3 * size:3 * size + k], staged[3 * size + k:].view(k, self.width))
        if self.engine.dp_layout:
            self.engine.begin_moe_step(n, size, size)
        graph.replay()
        return None if batch is None else logits[:n].clone()


def _drain(step) -> torch.Tensor:
    """A world-1 step has no collectives: run the generator to its result."""
    try:
        request = next(step)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError(f"a world-1 step asked for a collective ({type(request).__name__})")

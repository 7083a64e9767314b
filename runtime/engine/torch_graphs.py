"""Decode steps of the torch runner on a GPU as CUDA graphs, one per batch-size bucket, captured and warmed at load.

A decode step (every sequence one token, no image rows) of N sequences replays the graph of the smallest bucket
B >= N (powers of two up to the engine's slots): the step's ids, positions, slots and block tables are copied
into the bucket's static inputs, rows N..B-1 are padding that points at a spare slot and a spare cache block the
runner allocates past its own (`TorchEngine` sizes the pools num_slots + 1 and num_blocks + 1), and the logits
come back as the first N rows of the graph's static output. Warm-up and capture touch only the spare slot and
block, so loading changes no pool a sequence can own. Captured only where a step has no host synchronisation:
one local rank (world 1, or a tp-layout rank under mpiexec; NCCL collectives are captured with it), not in the
dp layout (the all-to-all's counts come back to the host). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_export.runtime.engine.batch import StepBatch
from moe_export.runtime.engine.torch_model import StepInputs

WARMUP_PREFILL_TOKENS = 16  # one eager prefill-shaped step at load compiles the prefill kernels' variants too


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

    @classmethod
    def for_engine(cls, engine) -> DecodeGraphs | None:
        """Captured graphs for a CUDA engine whose steps can be captured; None otherwise."""
        if len(engine.models) != 1 or engine.dp_layout:
            return None
        graphs = cls(engine)
        graphs.warm_up()
        for size in buckets(engine.num_slots):
            graphs.capture(size)
        return graphs

    def _static(self, size: int, tokens: int | None = None) -> StepInputs:
        """Inputs of `size` sequences of `tokens` each (default 1) on the spare slot and block."""
        dev, t = self.engine.device, tokens or 1
        cu = torch.arange(size + 1, device=dev) * t
        tables = torch.full((size, self.width), -1, dtype=torch.int64, device=dev)
        tables[:, 0] = self.spare_block
        return StepInputs(torch.zeros(size * t, dtype=torch.int64, device=dev),
                          torch.arange(t, device=dev).repeat(size), cu,
                          torch.full((size,), self.spare_slot, dtype=torch.int64, device=dev), tables, cu[1:] - 1)

    def _eager(self, inputs: StepInputs) -> torch.Tensor:
        e = self.engine
        step = e.models[self.rank].step(inputs, e.pools[self.rank], e.kernels[self.rank])
        if e.world is None:
            return _drain(step)
        return e.world.run(step, e.num_experts, [])

    def warm_up(self) -> None:
        """Compile every kernel variant once: a prefill-shaped step and a decode step, on the spare slot."""
        with torch.no_grad():
            self._eager(self._static(1, min(WARMUP_PREFILL_TOKENS, self.engine.block_size)))
            self._eager(self._static(1))
        torch.cuda.synchronize(self.engine.device)

    def capture(self, size: int) -> None:
        inputs = self._static(size)
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._eager(inputs)  # allocator warm-up on the capture stream
        torch.cuda.current_stream(self.engine.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            logits = self._eager(inputs)
        self.graphs[size] = (graph, inputs, logits)

    def covers(self, batch: StepBatch) -> bool:
        """A decode step (one token per sequence, no images) within the largest bucket."""
        n = batch.num_sequences
        return (batch.input_ids.shape[0] == n and n <= max(self.graphs) and batch.block_tables.shape[1] <= self.width
                and (batch.image_rows is None or batch.image_rows.shape[0] == 0))

    def replay(self, batch: StepBatch) -> torch.Tensor:
        """Logits [N, vocab] fp32 of a decode step (`covers`), from the smallest bucket's graph."""
        n = batch.num_sequences
        size = next(b for b in sorted(self.graphs) if b >= n)
        graph, inputs, logits = self.graphs[size]
        tables = np.full((size, self.width), -1, dtype=np.int64)
        tables[:, 0] = self.spare_block
        tables[:n] = -1
        tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        rows = np.zeros((3, size), dtype=np.int64)
        rows[2] = self.spare_slot
        rows[0, :n], rows[1, :n], rows[2, :n] = batch.input_ids, batch.positions, batch.slot_ids
        host = torch.from_numpy(np.concatenate([rows.ravel(), tables.ravel()]))
        device = self.engine.device
        staged = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        inputs.ids.copy_(staged[:size])
        inputs.positions.copy_(staged[size:2 * size])
        inputs.slots.copy_(staged[2 * size:3 * size])
        inputs.tables.copy_(staged[3 * size:].view(size, self.width))
        graph.replay()
        return logits[:n].clone()


def _drain(step) -> torch.Tensor:
    """A world-1 step has no collectives: run the generator to its result."""
    try:
        request = next(step)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError(f"a world-1 step asked for a collective ({type(request).__name__})")

"""Run under `mpiexec -n WORLD` with TRITON_INTERPRET=1 on a dp-layout torch engine (argv[1]): every rank loads with
the Triton kernel table (`CUDAKernels` on CPU tensors, as `torch_interpreter_run.py`: the experts in the W4A16
kernel's layout, each MoE call checked against the CPU kernel and the CPU result passed on: `checked_moe`), so its
MoE all-to-alls run
on the device transport (`DistributedWorld.use_device_transport`: Triton routing / packing under the interpreter,
gloo all-to-alls), and runs its group's steps in argv[2] (a JSON list of steps, each a list per group of chunks
[slot, start, tokens, blocks], or null: idle); from step argv[3] on, decode steps replay `DecodeGraphs` (buckets 1
and 2) whose graphs are eager stand-ins (no GPU here: a replay runs the step on the bucket's static inputs), so
the world agrees on a bucket and idle ranks replay padding. Counted over each step (`HostSyncs` below): reads of a tensor's
values (`item`, `tolist`, `cpu`, `numpy`, conversions) and `torch.cuda.synchronize`, outside the kernels (the Triton
kernels' and the transport kernels' host side is the interpreter's) and outside the runner's checks of its numpy
inputs; separately over `TorchEngine.finish_step` after it (the step's wait and its per-expert counts' read, as
`sample` does after the sampler). Rank 0 prints one JSON line {"logits": [step][group] -> [N, vocab] list or null,
"reads": [step][rank] -> list of read names in `step_logits`, "finish_reads": the same in `finish_step`, "expert_tokens": [step] -> sum of the group's per-expert counts, "moe_err": the largest
MoE error of any rank relative to max(1, max |y|)}."""

from __future__ import annotations

import functools
import json
import sys

import torch
from mpi4py import MPI

from moe_export.plugins.collectives import transport_kernels
from moe_export.runtime.engine import torch_runner
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.torch_graphs import DecodeGraphs
from moe_export.runtime.engine.torch_kernels import CUDAKernels
from moe_export.runtime.engine.torch_runner import TorchEngine
from torch_interpreter_run import checked_moe

READS = {"item": torch.Tensor.item, "tolist": torch.Tensor.tolist, "cpu": torch.Tensor.cpu,
         "numpy": torch.Tensor.numpy, "bool": torch.Tensor.__bool__, "int": torch.Tensor.__int__,
         "float": torch.Tensor.__float__, "index": torch.Tensor.__index__}


class HostSyncs:
    """Patches the reads and torch.cuda.synchronize to record their names while `counting` and not `paused`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.counting, self.paused = False, 0
        for name, method in READS.items():
            setattr(torch.Tensor, method.__name__, self._counted(name, method))
        torch.cuda.synchronize = self._counted("synchronize", lambda *a, **k: None)

    def _counted(self, name, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            if self.counting and not self.paused:
                self.calls.append(name)
            return method(*args, **kwargs)
        return wrapper

    def pausing(self, fn):
        """fn, with nothing counted inside it."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return wrapper


class EagerGraph:
    """A captured graph's stand-in: a replay runs the step again on the bucket's static inputs into its logits."""

    def __init__(self, graphs: DecodeGraphs, inputs, logits) -> None:
        self.graphs, self.inputs, self.logits = graphs, inputs, logits

    def replay(self) -> None:
        self.logits.copy_(self.graphs._eager(self.inputs))


def stand_in_graphs(engine: TorchEngine) -> DecodeGraphs:
    """Decode graphs of buckets 1 and 2 on the spare slot 2 and block 15 (past what the steps use)."""
    graphs = DecodeGraphs(engine)
    graphs.spare_slot, graphs.spare_block = 2, 15
    for size in (2, 1):
        inputs = graphs._static(size)
        graphs._begin(size)
        logits = graphs._eager(inputs)
        graphs.graphs[size] = (EagerGraph(graphs, inputs, logits), inputs, logits)
    return graphs


def main() -> None:
    world = MPI.COMM_WORLD
    syncs = HostSyncs()
    for name in ("route", "pack", "unpack", "expand", "sum_returned"):
        setattr(transport_kernels, name, syncs.pausing(getattr(transport_kernels, name)))
    moe_errors: list[float] = []
    CUDAKernels.moe = checked_moe(CUDAKernels.moe, moe_errors)
    for name in ("short_conv", "gated_delta_scan", "cache_write", "sparse_mla", "dsa_indexer", "moe"):
        setattr(CUDAKernels, name, syncs.pausing(getattr(CUDAKernels, name)))
    torch_runner.check_step_batch = syncs.pausing(torch_runner.check_step_batch)
    torch_runner.kernels_for = lambda device, pools: CUDAKernels(pools)  # the experts loaded in the kernel's layout
    engine = TorchEngine(sys.argv[1], num_slots=3, num_blocks=16, threads=1)
    logits, reads, finish_reads, experts = [], [], [], []
    for n, step in enumerate(json.loads(sys.argv[2])):
        if n == int(sys.argv[3]):
            engine.graphs = stand_in_graphs(engine)
        chunks = step[engine.group]
        batch = None if chunks is None else StepBatch.from_sequences([SequenceChunk(*c) for c in chunks])
        syncs.calls, syncs.counting = [], True
        out = engine.step_logits(batch)
        step_calls, syncs.calls = syncs.calls, []
        engine.finish_step()  # what `sample` does after the sampler (no sampling here: the stream's wait)
        syncs.counting = False
        mine = None if out is None or engine.rank % engine.tp else out.numpy().tolist()
        gathered = world.gather(mine, root=0)  # rank 0: every rank's; a group's logits from its first rank
        logits.append(None if gathered is None else gathered[::engine.tp])
        reads.append(world.gather(step_calls, root=0))
        finish_reads.append(world.gather(syncs.calls, root=0))
        experts.append(int(engine.group_step_expert_tokens.sum()))
    moe_err = world.gather(max(moe_errors, default=0.0), root=0)
    if world.Get_rank() == 0:
        print(json.dumps({"logits": logits, "reads": reads, "finish_reads": finish_reads, "expert_tokens": experts,
                          "moe_err": max(moe_err)}))


if __name__ == "__main__":
    main()

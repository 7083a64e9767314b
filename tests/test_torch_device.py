"""Device discipline of the torch runner's GPU path, on CPU: a text step and an image step (the vision tower, then a
step with its embeddings) on a rank whose device is `cuda:1`, under FakeTensorMode (`torch_device_support`), mix no
device; every thread that launches (the loading thread, the step worker) makes cuda:1 its current device; the
prefix-cache checkpoints are host memory."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from moe_export.runtime.engine import torch_runner
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.torch_runner import TorchEngine

from torch_device_support import ShapeKernels, count_syncs, fake_cuda, in_fake_mode

RANK_DEVICE = torch.device("cuda:1")


@pytest.fixture
def current_devices(monkeypatch):
    """(thread name, device) of each `torch.cuda.set_device` call (the CPU-only torch has no device to set)."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, torch.device(d))))
    monkeypatch.setattr(torch_runner, "kernels_for", lambda device, pools: ShapeKernels(device))
    return calls


def fake_engine(engine_dir, monkeypatch) -> TorchEngine:
    """The engine on cuda:1 (inside `fake_cuda`); the load's value reads (the experts' scale check before they
    are put in the W4A16 kernel's layout) answered with zeros (`count_syncs`: a load may read, a step may not)."""
    with count_syncs(monkeypatch):
        return TorchEngine(engine_dir, num_slots=2, num_blocks=8, device=str(RANK_DEVICE), cuda_graphs=False)


def test_text_step_on_cuda_1_in_a_worker_thread(runtime_engine, current_devices, monkeypatch):
    """tp 2 x ep 2 in one process (all-reduces, the vocab-parallel embedding, the all-gathered logits): a prefill
    and a decode step in a step worker thread, as `StepExecutor` runs them with overlap."""
    engine_dir = runtime_engine("tiny-k3-dsa", 2, 2, 4, backend="torch")
    with fake_cuda(monkeypatch) as mode:
        engine = fake_engine(engine_dir, monkeypatch)
        assert {d for _, d in current_devices} == {RANK_DEVICE}
        saved = [t for rows in engine.checkpoints.values() for t in rows.values()]
        assert saved and all(t.device.type == "cpu" for t in saved)  # host memory, as the planner counts them
        prefill = StepBatch.from_sequences([SequenceChunk(0, 0, [5, 17, 99, 3], [0]), SequenceChunk(1, 0, [7, 8], [1])])
        decode = StepBatch.from_sequences([SequenceChunk(0, 4, [11], [0]), SequenceChunk(1, 2, [12], [1])])
        with ThreadPoolExecutor(1, thread_name_prefix="moe-export-step") as worker:
            for batch in (prefill, decode):
                logits = worker.submit(in_fake_mode, mode, engine.step_logits, batch).result()
                assert logits.device == RANK_DEVICE and logits.shape == (2, engine.config.model.vocab_size)
            worker.submit(in_fake_mode, mode, engine.save_state, 0, 1).result()
            worker.submit(in_fake_mode, mode, engine.restore_state, 1, 1).result()
    threads = {t for t, d in current_devices if t.startswith("moe-export-step")}
    assert threads and all(d == RANK_DEVICE for t, d in current_devices)


def test_image_step_on_cuda_1(runtime_engine, current_devices, monkeypatch):
    """K3's tower (bf16 on the device, rope tables made there) on two images, then a step whose rows take their
    embeddings."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1, backend="torch")
    with fake_cuda(monkeypatch):
        engine = fake_engine(engine_dir, monkeypatch)
        tower = engine.vision.tower
        patch = tower.tower.vc.patch_size
        grids = [(1, 4, 6), (1, 2, 2)]
        pixels = torch.zeros(sum(t * h * w for t, h, w in grids), 3, patch, patch, device=RANK_DEVICE)
        embeds = tower.embed(pixels, grids)
        assert embeds.device == RANK_DEVICE and embeds.dtype == torch.bfloat16
        assert embeds.shape == (6 + 1, engine.image_width)
        rows = list(range(1, 8))
        batch = StepBatch.from_sequences([SequenceChunk(0, 0, [5] * 9, [0], rows, np.zeros((7, engine.image_width),
                                                                                           np.float32))],
                                         engine.image_width)
        logits = engine.step_logits(batch)
        assert logits.device == RANK_DEVICE
    assert current_devices and all(d == RANK_DEVICE for _, d in current_devices)


class EagerGraph:
    """A captured graph's stand-in (no GPU): a replay runs the step on the bucket's static inputs."""

    def __init__(self, graphs, inputs, logits) -> None:
        self.graphs, self.inputs, self.logits = graphs, inputs, logits

    def replay(self) -> None:
        self.logits.copy_(self.graphs._eager(self.inputs))


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 4)], ids=["world1", "tp2_ep2"])
def test_no_host_sync_in_a_tp_decode_step(runtime_engine, current_devices, monkeypatch, layout):
    """The runner's decode step (`step_logits`, what `sample` runs before the sampler; the sampler is counted by its
    own tests) reads nothing back from the device: no item / tolist / cpu / numpy / conversion, no blocking copy,
    no synchronize (`HostSyncs`), after a prefill; eagerly, and (world 1) through the decode graphs' replay (eager
    stand-ins for the graphs: the static inputs' copies and the block table's changed rows are what is counted)."""
    from moe_export.runtime.engine.torch_graphs import DecodeGraphs

    engine_dir = runtime_engine("tiny-k3-dsa", *layout, backend="torch")
    decode = [StepBatch.from_sequences([SequenceChunk(0, 4 + i, [11], [0]), SequenceChunk(1, 2 + i, [12], [1, 2])])
              for i in range(2)]
    with fake_cuda(monkeypatch):
        engine = fake_engine(engine_dir, monkeypatch)
        engine.step_logits(StepBatch.from_sequences([SequenceChunk(0, 0, [5, 17, 99, 3], [0]),
                                                     SequenceChunk(1, 0, [7, 8], [1])]))
        with count_syncs(monkeypatch) as syncs:
            engine.step_logits(decode[0])
        assert syncs.calls == []
        if len(engine.models) == 1:
            graphs = DecodeGraphs(engine)
            for size in (2, 1):
                inputs = graphs._static(size)
                logits = graphs._eager(inputs)
                graphs.graphs[size] = (EagerGraph(graphs, inputs, logits), inputs, logits)
            engine.graphs = graphs
            with count_syncs(monkeypatch) as syncs:
                assert engine.step_logits(decode[1]).shape == (2, engine.config.model.vocab_size)
            assert syncs.calls == []


def test_a_dp_step_waits_once_then_reads_its_expert_counts(monkeypatch):
    """The dp layout's device-transport step (`finish_step`, as `sample` runs it after the sampler): one wait per
    step: for the sampled ids' copy when the step sampled on the device (the counts' copy precedes it on the
    stream), else the stream's (an idle or follower rank, or a sampler that failed and copied nothing); then the
    per-expert counts from their host copy. No wait when no counts are pending or the caller already waited."""
    from types import SimpleNamespace

    from moe_export.runtime.engine.sampler import SampledTokens

    engine = object.__new__(TorchEngine)
    engine.device, engine.comm, engine.tp = torch.device("cuda", 1), None, 1
    engine.routed_host = torch.tensor([[1, 2], [0, 3]])
    engine.step_expert_tokens = np.zeros((2, 2), np.int64)
    engine.expert_tokens = np.zeros((2, 2), np.int64)
    waits: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=lambda: waits.append(f"stream {device}")))

    def sampled() -> SampledTokens:
        return SampledTokens.pending(lambda: waits.append("ids") or (np.zeros(1, np.int64), [None], [None], {}))

    failed = SampledTokens(np.zeros(1, np.int64), [None], [None], {0: "choosing its token failed"})
    for out, want in ((sampled(), ["ids"]), (None, ["stream cuda:1"]), (failed, ["stream cuda:1"])):
        waits.clear()
        engine.counts_pending = True
        engine.finish_step(out)
        assert waits == want
        assert engine.step_expert_tokens.tolist() == [[1, 2], [0, 3]] and not engine.counts_pending
    assert engine.expert_tokens.tolist() == [[3, 6], [0, 9]]
    waits.clear()
    engine.finish_step(sampled())  # no device-transport step since: nothing to wait for or count
    engine.counts_pending = True
    engine.finish_step(waited=True)  # `step` read its logits with a blocking copy: that was the wait
    assert waits == [] and engine.expert_tokens.tolist() == [[4, 8], [0, 12]]

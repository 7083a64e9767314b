"""The TensorRT runner's real constructor (`TensorRTEngine.__init__`) over stand-ins of TensorRT's runtime and of
torch.cuda (`tests/tensorrt_runtime_standin.py`), for an engine of each layout built by the real builder driver
(against the recording builder of test_build_tensorrt.py): the plan is streamed in from its file, the pools and
their table are allocated, and before the constructor returns the NCCL communicators are made and every plugin
kernel has run (one eager step on the spare slot, then each decode bucket's step and graph capture)."""

from __future__ import annotations

import shutil
import sys
import types

import pytest
import tensorrt_runtime_standin as rt
from moe_export.common.engine_config import EngineConfig
from moe_export.common.recipe import load_recipe
from moe_export.export.backends.tensorrt import engine as tensorrt_build
from moe_export.export.plan.planner import engine_memory, make_plan
from moe_export.export.convert.synth import preset_config
from moe_export.graphs.sharding import Mapping
from moe_export.plugins import tensorrt_runtime
from moe_export.runtime.engine import tensorrt as runner
from test_build_tensorrt import fake_tensorrt
from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: real tiny rank graphs)


def trt_recipe(layout: str):
    recipe, _ = load_recipe("tiny-cpu.yaml")
    quant = recipe.quantization.model_copy(update={"kv_cache": "fp8"})
    target = recipe.target.model_copy(update={"gpu": "h100", "memory_gib": 4.0,
                                              "gpus_per_node": 8 if layout == "dp" else 4})  # fmt: skip
    update = {"backend": "tensorrt", "target": target, "quantization": quant}
    if layout == "dp":
        update["parallel"] = recipe.parallel.model_copy(update={"tp": 2, "ep": 8, "attention": "dp"})
    return recipe.model_copy(update=update)


class FakeCommunicator:
    """A group's communicator as the runner drives it: the step state's buffers and `begin_step` recorded."""

    def __init__(self):
        self.steps, self.routed = [], None

    def reserve(self, device, layers, num_experts):
        import torch

        self.routed = torch.zeros((layers, num_experts), dtype=torch.int64)

    def begin_step(self, valid, block_rows):
        self.steps.append((valid, block_rows))


class FakeGroups:
    """`NcclGroups` without MPI or NCCL: the groups' communicators, and the warm-up recorded; the world's bucket
    agreement as a world of one."""

    def __init__(self, mapping):
        self.nccl = {name: FakeCommunicator() for name in ("tp", "ep")}
        self.world = types.SimpleNamespace(allreduce=lambda bid, op=None: bid)

    def warm_up(self, torch, device):
        rt.LOG.append(("nccl_warm_up",))


def engine_dir(tmp_path, monkeypatch, graph, layout: str, rank: int):
    """An engine folder holding rank `rank`'s graph and its engine file built through the builder driver."""
    recipe = trt_recipe(layout)
    mapping = Mapping.from_recipe(recipe, rank)
    folder = tmp_path / layout
    (folder / f"rank{rank}").mkdir(parents=True)
    shutil.copy(graph, folder / f"rank{rank}" / "model.onnx")
    model = preset_config("tiny-k3")
    EngineConfig.from_recipe(recipe, model, version="test", files={}, weight_classes={},
                             memory=engine_memory(recipe, model)).write(folder)
    view = make_plan(recipe).per_rank[rank].memory
    planned = view["activations"] + sum(view.get(f"workspace.{k}", 0) for k in tensorrt_build.ENGINE_WORKSPACES)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tensorrt", fake_tensorrt([], device_memory=planned))
        m.setattr(tensorrt_build, "register_plugins", lambda: None)
        m.setattr(tensorrt_build, "select_device", lambda: 0)
        tensorrt_build.build_tensorrt_engine(graph, recipe, mapping, folder / f"rank{rank}" / f"rank{rank}.engine")
    return folder, recipe


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_runner_constructor_streams_allocates_and_warms_up(tiny_graphs, tmp_path, monkeypatch, layout):  # noqa: F811
    graph, rank = (tiny_graphs[3], 1) if layout == "tp" else (tiny_graphs[4], 3)
    folder, recipe = engine_dir(tmp_path, monkeypatch, graph, layout, rank)
    meta, _, size = runner.read_engine_meta(folder / f"rank{rank}" / f"rank{rank}.engine")
    assert size == len(b"engine-bytes")
    vocab = preset_config("tiny-k3").vocab_size
    monkeypatch.setitem(sys.modules, "tensorrt", rt.runtime_module(b"engine-bytes", meta, vocab))
    monkeypatch.setitem(sys.modules, "torch", rt.cpu_torch())
    monkeypatch.setattr(tensorrt_runtime, "register_plugins", lambda: rt.LOG.append(("plugins",)))
    monkeypatch.setattr(tensorrt_runtime, "select_device", lambda: 0)
    monkeypatch.setattr(runner, "mpi_world", lambda: (rank, recipe.target.world_size))
    monkeypatch.setattr(runner, "NcclGroups", FakeGroups)
    monkeypatch.setattr("moe_export.common.engine_file.READ_CHUNK", 5)  # the plan arrives in several reads
    rt.LOG.clear()
    engine = runner.TensorRTEngine(folder)
    kinds = [e[0] for e in rt.LOG]
    assert kinds.index("plugins") < kinds.index("deserialized") < kinds.index("device_memory")
    assert ("device_memory", meta["device_memory_bytes"]) in rt.LOG
    assert next(e for e in rt.LOG if e[0] == "deserialized")[1:] == (size, 3)  # 12 bytes in reads of <= 5
    assert engine.num_slots == recipe.limits.max_batch and engine._pad_slot == engine.num_slots
    assert set(engine.pools) and engine.pool_table["pool_table"].shape[0] == len(engine.pools)
    # warm-up, all before the constructor returned: NCCL first, then the steps on the spare slot
    warm = kinds.index("nccl_warm_up")
    steps = [e for e in rt.LOG[warm:] if e[0] == "enqueue"]
    assert warm < kinds.index("enqueue") and all(e[2] is not None for e in steps)
    # one eager step (dp: the idle step), then each decode bucket: its eager step and the captured one
    assert engine._buckets == [1, 2, 4, 8] and sorted(engine._graphs) == engine._buckets
    assert [e[1] for e in steps] == [1, 1, 1, 2, 2, 4, 4, 8, 8] and kinds.count("capture") == 4
    if layout == "dp":  # nothing real; the counted transport for the eager step, then blocks of a tp-2 share
        assert engine.comm.nccl["ep"].steps == [(0, 0)] + [(0, -(-b // 2)) for b in (1, 2, 4, 8) for _ in "ec"]
    assert kinds[-1] == "synchronize"


def test_nccl_groups_warm_up_every_group_in_one_order():
    calls = []
    comm = types.SimpleNamespace(nccl={n: types.SimpleNamespace(all_reduce=lambda x, out, n=n: calls.append(n))
                                       for n in ("ep", "tp")})  # fmt: skip
    runner.NcclGroups.warm_up(comm, rt.torch, "cpu")
    assert calls == ["tp", "ep"]

"""K3's tower on the TensorRT backend, as far as it runs without TensorRT: the `vision.engine` build driven
against the recording stand-in of TensorRT's builder API (profile from the image limits, workspace and
device-memory budget from the planner, no plugin preference, file format), the runner's tower over stand-ins
of the execution context and torch.cuda (profile checks before TensorRT sees a shape, one stream, one wait),
and the spreading of a call's images over an attention group."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import test_tensorrt_engine as trt_fakes
import torch
from moe_export.common.errors import InputError
from moe_export.common.recipe import load_recipe
from moe_export.export.backends.tensorrt import vision as tensorrt_vision
from moe_export.export.plan.planner import image_patch_limit, vision_activation_bytes
from moe_export.export.convert.synth import preset_config
from moe_export.common.engine_file import read_engine_file
from moe_export.graphs.vision import VISION_NORM_EPS, vision_config, vision_tensor_specs
from moe_export.graphs.vision_export import export_vision_graph, tower_inputs
from moe_export.runtime.engine.tensorrt_vision import TensorRTTower
from moe_export.runtime.engine.vision import encode_spread
from safetensors.torch import save_file
from test_build_tensorrt import fake_tensorrt


@pytest.fixture(scope="module")
def tower_graph(tmp_path_factory):
    """tiny-k3's tower graph over random weights, and the model config it belongs to."""
    cfg = preset_config("tiny-k3")
    vc = vision_config(cfg)
    root = tmp_path_factory.mktemp("tower")
    gen = torch.Generator().manual_seed(0)
    save_file({s.name: (torch.randn(s.shape, generator=gen) * 0.05).to(torch.bfloat16) for s in vision_tensor_specs(vc)},
              str(root / "vision.safetensors"))
    export_vision_graph(vc, root / "vision.safetensors", root / "vision.onnx", VISION_NORM_EPS["float32"])
    return root / "vision.onnx", cfg


def trt_recipe():
    recipe, _ = load_recipe("tiny-cpu.yaml")  # tp 2, 4 images per request, patch limit 4096
    return recipe.model_copy(update={"backend": "tensorrt", "target": recipe.target.model_copy(
        update={"gpu": "h100", "memory_gib": 4.0})})


def test_tower_engine_built_from_the_image_limits(tower_graph, tmp_path, monkeypatch):
    graph, cfg = tower_graph
    recipe = trt_recipe()
    planned = vision_activation_bytes(cfg, recipe)
    log: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(log, device_memory=planned))
    monkeypatch.setattr(tensorrt_vision, "select_device", lambda: log.append(("device",)) or 0)
    out = tmp_path / "vision.engine"
    tensorrt_vision.build_vision_engine(graph, recipe, cfg, out)
    kinds = [e[0] for e in log]
    assert [e[1] for e in log if e[0] == "parse"] == [str(graph)] and kinds.index("device") < kinds.index("build")
    assert ("network_flags", 1 << 0) in log  # STRONGLY_TYPED (fp32 graph), no plugin preference: no plugins
    assert ("workspace", planned) in log and ("build", False, None) in log  # no collective to idle
    (shapes,) = [{k: tuple(map(tuple, v)) for k, v in e[1].items()} for e in log if e[0] == "profile"]
    per_rank, patches = 2, image_patch_limit(cfg, recipe)  # ceil(4 images / tp 2) on each rank
    assert patches == 4096
    vc = vision_config(cfg)
    assert shapes["pixel_values"] == ((4, 588), (4096, 588), (per_rank * patches, 588))
    assert shapes["rope_cos"][2] == (per_rank * patches, vc.head_dim // 2)
    assert shapes["cu_seqlens"] == ((2,), (2,), (per_rank + 1,))
    assert shapes["merge_index"] == ((1, 4), (1024, 4), (per_rank * patches // 4, 4))
    meta, blob = read_engine_file(out)
    assert blob == b"engine-bytes" and meta["rank"] is None and meta["device_memory_bytes"] == planned
    assert {k: tuple(map(tuple, v)) for k, v in meta["profile"].items()} == shapes
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(log, device_memory=planned + 1))
    with pytest.raises(InputError, match="limits.max_image_patches"):
        tensorrt_vision.build_vision_engine(graph, recipe, cfg, tmp_path / "again.engine")
    assert not (tmp_path / "again.engine").exists()
    one = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"tp": 1, "ep": 1}),
                                    "target": recipe.target.model_copy(update={"gpus_per_node": 1})})
    model = onnx.load(str(graph), load_external_data=False)
    assert tensorrt_vision.vision_profile(model, one, cfg)["cu_seqlens"][2] == [5]  # one rank encodes all 4 images


class TowerTorch(trt_fakes.FakeTorch):
    uint8 = "u8"


class FakeEngine:
    device_memory_size_v2 = 4096

    def __init__(self, context):
        self.context = context

    def create_execution_context(self, strategy):
        trt_fakes.RECORD.append(("context", strategy))
        return self.context


class TowerContext(trt_fakes.StepContext):
    def __init__(self):
        super().__init__()
        self.memory = None

    def set_device_memory(self, ptr, size):
        self.memory = size

    def get_tensor_shape(self, name):
        return (self.rows, 64)

    def set_input_shape(self, name, shape):
        if name == "merge_index":
            self.rows = shape[0]
        return super().set_input_shape(name, shape)


def test_runner_tower_checks_the_profile_and_runs_on_the_rank_stream(tower_graph, tmp_path, monkeypatch):
    graph, cfg = tower_graph
    recipe = trt_recipe()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt([], device_memory=vision_activation_bytes(cfg, recipe)))
    tensorrt_vision_engine = tmp_path / "vision.engine"
    monkeypatch.setattr(tensorrt_vision, "select_device", lambda: 0)
    tensorrt_vision.build_vision_engine(graph, recipe, cfg, tensorrt_vision_engine)
    context, stream = TowerContext(), trt_fakes.FakeStream()
    runtime = type("Runtime", (), {"deserialize_cuda_engine": lambda self, reader: FakeEngine(context)})()
    trt = sys.modules["tensorrt"]
    monkeypatch.setattr(trt, "ExecutionContextAllocationStrategy", type("S", (), {"USER_MANAGED": "user"}), raising=False)
    trt_fakes.RECORD.clear()
    tower = TensorRTTower(tensorrt_vision_engine, runtime, trt, TowerTorch, "cuda:0", stream)
    assert ("context", "user") in trt_fakes.RECORD and context.memory == FakeEngine.device_memory_size_v2
    vc = vision_config(cfg)
    grids = [(1, 4, 6), (1, 2, 2)]
    feeds = tower_inputs(vc, np.zeros((28, 3, 14, 14), np.float32), grids)
    trt_fakes.RECORD.clear()
    out = tower(feeds)
    assert out.shape == (6 + 1, 64)  # the merged tokens of both images, as the context reports them
    shapes = {c[1]: c[2] for c in context.calls if c[0] == "shape"}
    assert shapes == {k: tuple(v.shape) for k, v in feeds.items()}
    assert [c[1] for c in context.calls if c[0] == "address"][-1] == "image_embeds"
    events = [e for e in trt_fakes.RECORD if e[0] != "alloc"]
    assert all(e[1] is stream for e in events if e[0] in ("copy", "enqueue"))  # every copy and the enqueue
    assert events[-1] == ("synchronize", None) and [e[0] for e in events].count("synchronize") == 1
    three = tower_inputs(vc, np.zeros((12, 3, 14, 14), np.float32), [(1, 2, 2)] * 3)  # 3 images > 2 per rank
    context.calls.clear()
    with pytest.raises(InputError, match="outside the engine's profile"):
        tower(three)
    assert not any(c[0] == "shape" and c[1] == "cu_seqlens" for c in context.calls)  # refused before TensorRT


class FakeGroup:
    """Rank `rank` of an MPI communicator of `size` ranks; gather returns every rank's list (computed by
    `others`) on rank 0, None elsewhere."""

    def __init__(self, rank, size, others):
        self.rank, self.size, self.others = rank, size, others

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def gather(self, mine, root):
        if self.rank != root:
            return None
        return [mine if r == self.rank else self.others(r) for r in range(self.size)]


class Tower:
    def __init__(self):
        self.calls = []

    def run(self, items):
        self.calls.append([it[1] for it in items])
        return [f"emb{it[1]}" for it in items]


def test_images_spread_over_the_attention_group():
    items = [(None, k) for k in range(5)]
    mine, other = Tower(), Tower()
    out = encode_spread(mine, items, FakeGroup(0, 2, lambda r: other.run([it for i, it in enumerate(items) if i % 2 == r])))
    assert out == [f"emb{k}" for k in range(5)]  # back in request order
    assert mine.calls == [[0, 2, 4]] and other.calls == [[1, 3]]
    follower = Tower()
    assert encode_spread(follower, items, FakeGroup(1, 2, None)) == [] and follower.calls == [[1, 3]]
    alone = Tower()
    assert encode_spread(alone, items, None) == [f"emb{k}" for k in range(5)] and alone.calls == [[0, 1, 2, 3, 4]]


def test_runner_without_a_tower_engine_refuses_images(tmp_path):
    from moe_export.runtime.engine.tensorrt import TensorRTEngine

    engine = object.__new__(TensorRTEngine)
    engine.dir, engine.vision = tmp_path, None
    with pytest.raises(InputError, match="no vision tower engine"):
        engine.encode_images([(np.zeros((4, 3, 14, 14), np.float32), [1, 2, 2])])

"""TensorRT builder parts that run without TensorRT: the one-engine-per-rank build driven against a recording
stand-in of TensorRT's builder API, profile dimensions, placement, the import guard, the GPU graph."""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import onnx
import pytest
from moe_export.common.errors import InputError
from moe_export.common.recipe import load_recipe
from moe_export.export.backends.tensorrt import engine as tensorrt_build
from moe_export.export.plan.planner import make_plan
from moe_export.common.engine_file import read_engine_file
from moe_export.export.backends.tensorrt.engine import (
    build_tensorrt_engine,
    engine_profile,
    profile_range,
)
from moe_export.graphs.sharding import Mapping
from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: real tiny rank graphs)


def test_every_engine_input_has_profile_dims(tiny_graphs):  # noqa: F811
    recipe, _ = load_recipe("h100x64.yaml")
    limits, sizes = recipe.limits, make_plan(recipe).pool_sizes()
    for path in tiny_graphs[2:]:  # the graphs exported for backend tensorrt
        model = onnx.load(str(path), load_external_data=False)
        profile = engine_profile(model, recipe)
        assert set(profile) == {v.name for v in model.graph.input}
        for low, opt, high in profile.values():
            assert all(lo <= op <= hi for lo, op, hi in zip(low, opt, high))
        assert not [n for n in profile if n.startswith(("kda_state.", "conv_state.", "mla_cache.", "index_cache."))]
        rows = next(d.dim_value for d in next(v for v in model.graph.input if v.name == "pool_table").type.tensor_type.shape.dim)
        assert profile["pool_table"] == [[rows, 3]] * 3  # the pools are the runner's: only their table is an input
    per_sequence = -(-limits.max_seq_len // limits.block_size)
    assert sizes.num_blocks >= per_sequence and sizes.num_slots == limits.max_batch
    assert profile_range("block_tables", 1, "B", limits, sizes) == (1, 64, per_sequence)
    assert profile_range("input_ids", 0, "T", limits, sizes) == (1, 256, limits.max_num_tokens)
    with pytest.raises(InputError, match="unknown symbolic dimension"):
        profile_range("x", 0, "Q", limits, sizes)


def test_builder_without_tensorrt_is_a_clear_error(tmp_path):
    assert importlib.util.find_spec("tensorrt") is None
    recipe, _ = load_recipe("h100x64.yaml")
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        build_tensorrt_engine(tmp_path / "model.onnx", recipe, Mapping(64, 0, 8, 64), tmp_path / "rank0.engine")
    assert not any(tmp_path.iterdir())


# ------------------------------------------------ the build against a recording stand-in of TensorRT's API
def fake_tensorrt(log: list, device_memory: int):
    """The builder API calls `build_tensorrt_engine` makes, recorded; `build_serialized_network` notes whether
    the collective plugins were in their build-time no-op state."""
    from moe_export.plugins.collectives import nccl

    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Network:
        def __init__(self, flags):
            log.append(("network_flags", flags))
            self.names = []

        @property
        def num_inputs(self):
            return len(self.names)

        def get_input(self, i):
            return Obj(name=self.names[i])

        num_outputs = 1

        def get_output(self, i):
            return Obj(name="logits")

    class Parser:
        def __init__(self, network, logger):
            self.network, self.num_errors = network, 0

        def parse_from_file(self, path):
            log.append(("parse", path))
            model = onnx.load(path, load_external_data=False)
            self.network.names = [v.name for v in model.graph.input]
            return True

    class Config:
        def set_memory_pool_limit(self, pool, size):
            log.append(("workspace", size))

        def __setattr__(self, name, value):
            log.append((name, value))
            object.__setattr__(self, name, value)

        def set_preview_feature(self, feature, on):
            log.append(("preview_feature", feature, on))

        def create_timing_cache(self, blob):
            return Obj(serialize=lambda: b"cache")

        def set_timing_cache(self, cache, ignore_mismatch):
            return True

        def add_optimization_profile(self, profile):
            log.append(("profile", profile.shapes))
            return 0

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, low, opt, high):
            self.shapes[name] = (low, opt, high)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            log.append(("build", nccl.is_building(), getattr(config, "max_aux_streams", None)))
            return b"engine-bytes"

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, reader):
            plan = b""
            while chunk := reader.read(3, 0):  # pulled in chunks (IStreamReaderV2), never handed whole
                plan += chunk
            log.append(("deserialize", plan))
            return Obj(device_memory_size_v2=device_memory, num_layers=42)

    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.9.0.34"
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, s=2: None})
    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, Parser, Runtime
    trt.NetworkDefinitionCreationFlag = Obj(STRONGLY_TYPED=0, PREFER_JIT_PYTHON_PLUGINS=4, PREFER_AOT_PYTHON_PLUGINS=5)
    trt.MemoryPoolType = Obj(WORKSPACE=0)
    trt.IStreamReaderV2 = type("IStreamReaderV2", (), {"__init__": lambda self: None})
    trt.SeekPosition = Obj(SET=0, CUR=1, END=2)
    trt.PreviewFeature = Obj(ALIASED_PLUGIN_IO_10_03=1)
    return trt


@pytest.mark.parametrize("prefer_aot", [False, True])
def test_one_engine_per_rank_built_with_collectives_idle(tiny_graphs, tmp_path, monkeypatch, prefer_aot):  # noqa: F811
    """The whole rank graph is one network (collective nodes included), built on
    the rank's GPU with the collective plugins in their no-op build state, AOT or JIT from the recipe; the
    engine's device memory is checked against the plan and recorded. Before it, a probe engine of the first
    layers (one of each kind) is built the same way and its activation memory checked: over budget, the rank is
    refused before its whole graph is even parsed."""
    gpu_path = tiny_graphs[2]
    recipe, _ = load_recipe("tiny-cpu.yaml")
    recipe = recipe.model_copy(update={"backend": "tensorrt", "target": recipe.target.model_copy(
        update={"gpu": "h100", "memory_gib": 4.0}), "tensorrt": recipe.tensorrt.model_copy(update={"prefer_aot": prefer_aot})})  # fmt: skip
    log: list = []
    view = make_plan(recipe).per_rank[1].memory
    budget = view["activations"] + view["workspace.moe_mxfp4"]  # the MoE workspace is an engine output
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(log, device_memory=budget))
    monkeypatch.setattr(tensorrt_build, "register_plugins", lambda: log.append(("plugins",)))
    monkeypatch.setattr(tensorrt_build, "select_device", lambda: log.append(("device",)) or 0)
    out = tmp_path / "rank1.engine"
    build_tensorrt_engine(gpu_path, recipe, Mapping(4, 1, 2, 2), out)
    kinds = [e[0] for e in log]
    parses = [e[1] for e in log if e[0] == "parse"]
    assert parses == [str(gpu_path.with_name("probe.onnx")), str(gpu_path)]  # the probe, then the whole graph once
    assert not gpu_path.with_name("probe.onnx").exists() and not gpu_path.with_name("probe.engine").exists()
    assert kinds.index("device") < kinds.index("build")
    assert [e for e in log if e[0] == "build"] == [("build", True, 0)] * 2  # collectives idle; one stream (MAX_AUX_STREAMS)
    assert ("deserialize", b"engine-bytes") in log  # the plan read back from the file it was streamed to
    flags = next(e[1] for e in log if e[0] == "network_flags")
    assert flags == (1 << 0) | (1 << (5 if prefer_aot else 4))
    meta, blob = read_engine_file(out)
    assert blob == b"engine-bytes" and meta["prefer_aot"] is prefer_aot and meta["device_memory_bytes"] == budget
    assert meta["probe_device_memory_bytes"] == budget
    graph = onnx.load(str(gpu_path), load_external_data=False)
    assert set(meta["profile"]) == {v.name for v in graph.graph.input}
    assert {n.op_type for n in graph.graph.node} >= {"AllReduce", "AllGather"}  # inside the engine
    # an engine needing more activation memory than the plan set aside is refused, at its probe
    log.clear()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(log, device_memory=budget + 1))
    with pytest.raises(InputError, match=r"first \d+ layers alone need .* activation memory \(probe engine\)"):
        build_tensorrt_engine(gpu_path, recipe, Mapping(4, 1, 2, 2), tmp_path / "again.engine")
    assert [e[1] for e in log if e[0] == "parse"] == [str(gpu_path.with_name("probe.onnx"))]  # never the whole
    # a recipe that does not fit is refused before anything is parsed
    small = recipe.model_copy(update={"target": recipe.target.model_copy(update={"memory_gib": 0.05})})
    log.clear()
    with pytest.raises(InputError, match="does not fit"):
        build_tensorrt_engine(gpu_path, small, Mapping(4, 1, 2, 2), tmp_path / "small.engine")
    assert not [e for e in log if e[0] == "parse"]


def test_prefer_aot_reachable_from_a_recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nmodel:\n  source: synthetic:tiny-k3\ntarget:\n  gpu: h100\n  nodes: 1\n  gpus_per_node: 1\n"
                 "backend: tensorrt\ntensorrt:\n  prefer_aot: true\n")
    recipe, _ = load_recipe(p)
    assert recipe.tensorrt.prefer_aot is True
    p.write_text(p.read_text().replace("prefer_aot: true", "prefer_jit: true"))
    with pytest.raises(InputError, match="tensorrt.prefer_jit"):
        load_recipe(p)


def test_local_rank_picks_the_gpu():
    """Under mpiexec every local rank built and ran on GPU 0."""
    import subprocess
    import sys

    from moe_export.common.mpi import device_for_local_rank, local_rank

    assert local_rank({}) == 0
    assert local_rank({"PMI_RANK": "5", "MPI_LOCALRANKID": "1"}) == 1
    assert local_rank({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == 3
    assert local_rank({"SLURM_LOCALID": "2"}) == 2
    assert [device_for_local_rank(r, 8, {}) for r in range(8)] == list(range(8))
    with pytest.raises(RuntimeError, match="only 8 CUDA device"):
        device_for_local_rank(8, 8, {})
    with pytest.raises(RuntimeError, match="no CUDA device"):
        device_for_local_rank(0, 0, {})
    # srun --gpus-per-task=1: each task sees only its own GPU (CUDA_VISIBLE_DEVICES narrowed to one id)
    srun = {"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "3"}
    assert device_for_local_rank(local_rank(srun), 1, srun) == 0
    # one GPU visible without a launcher narrowing it: a second local rank would share it, refused
    with pytest.raises(RuntimeError, match="only 1 CUDA device"):
        device_for_local_rank(1, 1, {"SLURM_LOCALID": "1"})
    with pytest.raises(RuntimeError, match="only 2 CUDA device"):
        device_for_local_rank(2, 2, {"CUDA_VISIBLE_DEVICES": "4,5"})
    code = "from moe_export.common.mpi import local_rank; print(f'<{local_rank()}>')"
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    # tagged: mpiexec forwards the ranks' output as it comes, so two lines can interleave ("01\n\n")
    assert sorted(re.findall(r"<(\d+)>", res.stdout)) == ["0", "1"]


def test_gpu_graph_computes_in_bf16_with_fp32_where_needed(tiny_graphs):  # noqa: F811
    """TensorRT folds a Cast of an initializer into a converted copy, so the weight Casts in a graph are the
    weights the engine holds converted: in the GPU (bf16) graph only router, norm and attention-residual
    weights (fp32 by design); in the CPU (fp32) graph every bf16 weight."""
    from moe_export.graphs.weights import classify_tensor_name
    from moe_export.plugins.registry import register_all_schemas

    register_all_schemas()
    cpu_path, gpu_path = tiny_graphs[1], tiny_graphs[2]  # tiny-k3-dsa exported for onnxruntime / tensorrt
    onnx.checker.check_model(str(gpu_path), full_check=True)
    gpu = onnx.load(str(gpu_path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(gpu, check_type=True, strict_mode=True)
    types_ = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert types_["logits"] == onnx.TensorProto.FLOAT

    def cast_weights(model):
        inits = {t.name: t for t in model.graph.initializer}
        return {n.input[0]: inits[n.input[0]] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in inits}

    gpu_casts = cast_weights(gpu)
    assert {classify_tensor_name(n) for n in gpu_casts} <= {"router", "norms", "attn_res", "mla", "indexer", "latent_proj"}
    assert all(len(t.dims) == 1 or classify_tensor_name(n) in ("router", "attn_res") for n, t in gpu_casts.items())
    cpu_casts = cast_weights(onnx.load(str(cpu_path), load_external_data=False))
    bf16 = [t.name for t in gpu.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16 and t.dims]
    assert set(bf16) <= set(cpu_casts) and len(bf16) > len(gpu_casts)
    # MXFP4 experts: int8 views of the uint8 bytes (the parser would widen uint8 to int32), never expanded
    experts = [t for t in gpu.graph.initializer if ".experts." in t.name]
    assert experts and all(t.data_type == onnx.TensorProto.INT8 for t in experts)
    cpu = onnx.load(str(cpu_path), load_external_data=False)
    cpu_experts = {t.name: t for t in cpu.graph.initializer if ".experts." in t.name}
    # the same number of bytes as the CPU build's (TensorRT builds hold them in the W4A16 kernel's layout,
    # plugins/moe_mxfp4/layout.py: other bytes, so another place in another weights file)
    length = lambda t: {e.key: e.value for e in t.external_data}.get("length")  # noqa: E731
    assert all(cpu_experts[t.name].data_type == onnx.TensorProto.UINT8 and list(cpu_experts[t.name].dims) == list(t.dims)
               and length(t) is not None and length(cpu_experts[t.name]) == length(t) for t in experts)  # fmt: skip
    # activations between layers and the collectives are bf16; gates, state and plugin fp32 inputs stay fp32
    reduces = [n for n in gpu.graph.node if n.op_type == "AllReduce"]
    assert reduces and all(types_[n.output[0]] == onnx.TensorProto.BFLOAT16 for n in reduces)
    for n in gpu.graph.node:
        if n.op_type == "GatedDeltaScan":
            assert [types_.get(i) for i in n.input[:5]] == [16, 16, 16, 1, 1]


def test_gpu_graph_reaches_pools_through_the_pool_table(tiny_graphs):  # noqa: F811
    """Issue 18, defect 4: TensorRT graphs take no pool and return none (TensorRT "may insert copies" for aliased
    plugin I/O, contract ALIASED_PLUGIN_IO_MAY_COPY): one input `pool_table` [P, 3] int64; every pool op names its
    row (`pool`), the metadata lists the pools in row order with the CPU graph's pool names, types and shapes;
    GatedDeltaScan / ShortConv take the step's slot ids; one PagedCacheWrite per cache pool writes the rows its
    readers then take from its output. The stand-in parser refuses the ONNX Runtime graph's pool I/O."""
    import json

    from moe_export.graphs.onnx_export import POOL_TABLE, POOLS_KEY
    from tensorrt_standin import ParserRefusal, require_pools_outside_io

    cpu, gpu = (onnx.load(str(p), load_external_data=False) for p in (tiny_graphs[1], tiny_graphs[2]))
    prefixes = ("kda_state.", "conv_state.", "mla_cache.", "index_cache.")
    assert not [v.name for v in (*gpu.graph.input, *gpu.graph.output) if v.name.startswith(prefixes)]
    table = next(v for v in gpu.graph.input if v.name == POOL_TABLE)
    pools = json.loads({p.key: p.value for p in gpu.metadata_props}[POOLS_KEY])
    assert [d.dim_value for d in table.type.tensor_type.shape.dim] == [len(pools), 3]
    assert table.type.tensor_type.elem_type == onnx.TensorProto.INT64
    cpu_pools = {v.name: v.type.tensor_type for v in cpu.graph.input if v.name.startswith(prefixes)}
    assert [p["name"] for p in pools] == list(cpu_pools)
    for p in pools:
        want, cache = cpu_pools[p["name"]], p["name"].startswith(("mla_", "index_"))
        dims = [d.dim_param or d.dim_value for d in want.shape.dim]
        assert p["dims"] == (dims[:-1] + [dims[-1] + 1] if cache else dims)  # fp8 rows: one scale byte more
        assert p["elem_type"] == (onnx.TensorProto.UINT8 if cache else want.elem_type)
    row = {p["name"]: i for i, p in enumerate(pools)}
    by_op: dict = {}
    consumers = {i: n for n in gpu.graph.node for i in n.input}
    for n in gpu.graph.node:
        if POOL_TABLE in n.input:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            by_op.setdefault(n.op_type, []).append(pools[attrs["pool"]]["name"])
            if n.op_type in ("GatedDeltaScan", "ShortConv"):
                assert n.input[-1] == "slot_ids" and len(n.output) == 1
            else:
                assert attrs["block_size"] == 64 and attrs["pool_dtype"] == b"fp8"
            if n.op_type == "PagedCacheWrite":  # its output (the rows) feeds the pool's reader
                reader = consumers[n.output[0]]
                reader_pool = {a.name: a.i for a in reader.attribute}["pool"]
                assert reader.op_type in ("SparseMLAAttention", "DSAIndexer") and reader_pool == attrs["pool"]
    assert sorted(by_op["GatedDeltaScan"]) == sorted(n for n in row if n.startswith("kda_state."))
    assert sorted(by_op["ShortConv"]) == sorted(n for n in row if n.startswith("conv_state."))
    assert sorted(by_op["PagedCacheWrite"]) == sorted(n for n in row if n.startswith(("mla_cache.", "index_cache.")))
    require_pools_outside_io(gpu)
    with pytest.raises(ParserRefusal, match="ALIASED_PLUGIN_IO_MAY_COPY"):
        require_pools_outside_io(cpu)
    assert not any(n.op_type == "PagedCacheWrite" for n in cpu.graph.node)
    assert {o.name for o in cpu.graph.output} >= {name + ".out" for name in cpu_pools}


def test_builder_leaves_aliased_plugin_io_off(tiny_graphs, tmp_path, monkeypatch):  # noqa: F811
    """The builder no longer turns on PreviewFeature.ALIASED_PLUGIN_IO_10_03 (nothing is
    aliased) and records the pool limits the runner sizes its pools within."""
    recipe, _ = load_recipe("tiny-cpu.yaml")
    recipe = recipe.model_copy(update={"backend": "tensorrt", "target": recipe.target.model_copy(
        update={"gpu": "h100", "memory_gib": 4.0})})  # fmt: skip
    log: list = []
    view = make_plan(recipe).per_rank[1].memory
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(log, device_memory=view["activations"]))
    monkeypatch.setattr(tensorrt_build, "register_plugins", lambda: None)
    monkeypatch.setattr(tensorrt_build, "select_device", lambda: 0)
    build_tensorrt_engine(tiny_graphs[2], recipe, Mapping(4, 1, 2, 2), tmp_path / "rank1.engine")
    assert not [e for e in log if e[0] == "preview_feature"]
    meta, _ = read_engine_file(tmp_path / "rank1.engine")
    pools = make_plan(recipe).pool_sizes()
    assert meta["pool_limits"] == {"slots": pools.num_slots + 1, "blocks": pools.num_blocks}


def test_stream_and_aux_stream_bindings_are_where_the_pinned_wheels_have_them():
    """Contracts MAX_AUX_STREAMS and ENGINE_STREAMS: `max_aux_streams`, `IStreamReaderV2` /
    `deserialize_cuda_engine(stream_reader_v2)` in both pinned bindings, `build_serialized_network_to_stream` /
    `IStreamWriter` only in 11.4 (the builder falls back to the IHostMemory buffer there); the builder and the
    runner use exactly these names."""
    import zipfile
    from pathlib import Path

    from moe_export.plugins.tensorrt_contracts import STREAM_BINDINGS
    from tensorrt_standin import PINNED_WHEELS, WHEEL_DIR

    root = Path(__file__).resolve().parents[1]
    code = "".join((root / f).read_text() for f in ("export/backends/tensorrt/engine.py", "common/engine_file.py"))
    assert all(name in code for name in STREAM_BINDINGS if name != "stream_reader_v2")
    for version, stem in PINNED_WHEELS.items():
        wheels = sorted(WHEEL_DIR.glob(f"{stem}-*.whl"))
        assert wheels, f"no {stem} wheel in {WHEEL_DIR}: run the README's test command"
        with zipfile.ZipFile(wheels[0]) as zf:
            so = zf.read("tensorrt_bindings/tensorrt.so")
        for name, versions in STREAM_BINDINGS.items():
            assert ((b"\0" + name.encode() + b"\0") in so) == (version in versions), (version, name)


def test_probe_graph_is_the_first_layer_of_each_kind_and_parses(tiny_graphs):  # noqa: F811
    """The probe (`tensorrt_build.probe_graph`) of each TensorRT rank graph: its layers up to the first of every
    layer plugin (KDA, MLA, MoE; the indexer where there is one), no head, the residual stream and what later
    layers read as outputs; a valid ONNX model (checker, full) holding nothing TensorRT's parser refuses."""
    from moe_export.export.backends.tensorrt.engine import probe_graph
    from moe_export.plugins.registry import register_all_schemas
    from tensorrt_parser_rules import parser_refusals

    register_all_schemas()
    for path in tiny_graphs[2:]:  # tiny-k3-dsa tp, tiny-k3 tp, tiny-k3 dp: backend tensorrt
        model = onnx.load(str(path), load_external_data=False)
        probe = probe_graph(model)
        layers = int(next(p.value for p in probe.metadata_props if p.key == "probe_layers"))
        plugins = {n.op_type for n in model.graph.node if n.domain and n.name.startswith("layers.")}
        assert plugins <= {n.op_type for n in probe.graph.node if n.domain}  # every layer plugin, collectives too
        assert plugins >= {"GatedDeltaScan", "SparseMLAAttention", "MoEMXFP4"}
        assert 0 < layers < max(int(n.name.split(".")[1]) for n in model.graph.node if n.name.startswith("layers.")) + 1
        assert not [n for n in probe.graph.node if n.name.startswith(("lm_head", "final", "logits"))]
        assert f"layers.{layers - 1}.mlp_residual" in {o.name for o in probe.graph.output}
        assert parser_refusals(probe) == [], path
        probe_path = path.with_name("probe_check.onnx")
        probe_path.write_bytes(probe.SerializeToString())
        onnx.checker.check_model(str(probe_path), full_check=True)
        probe_path.unlink()

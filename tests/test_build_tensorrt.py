"""TensorRT builder parts that run without TensorRT: segments, profile dimensions, the import guard."""

from __future__ import annotations

import importlib.util

import onnx
import pytest

from moe_export.export.backends import _value_types, plan_segments
from moe_export.export.errors import InputError
from moe_export.export.planner import make_plan
from moe_export.export.tensorrt_build import build_tensorrt_engine, profile_range, segment_input_dims
from moe_export.graphs.sharding import Mapping
from moe_export.recipes.schema import load_recipe

from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: two real tiny rank graphs)


def test_every_segment_input_has_profile_dims(tiny_graphs):  # noqa: F811
    recipe, _ = load_recipe("h100x64.yaml")
    limits, sizes = recipe.limits, make_plan(recipe).pool_sizes()
    for path in tiny_graphs:
        model = onnx.load(str(path), load_external_data=False)
        dims = segment_input_dims(model, _value_types(model), Mapping(4, 1, 2, 2))
        segments = [s for s in plan_segments(model) if not isinstance(s, dict)]
        assert set(dims) == {i for s in segments for i in s.inputs}
        for name, value_dims in dims.items():
            for axis, d in enumerate(value_dims):
                low, opt, high = profile_range(name, axis, d, limits, sizes)
                assert 1 <= low <= opt <= high or low == opt == high or (d == "M" and low == 0 < opt <= high)  # no image rows
        pools = [v for n, v in dims.items() if n.startswith(("mla_cache.", "index_cache."))]
        assert pools and all(v[:2] == ["NB", "BS"] for v in pools)
    # pools follow the planner's pool sizes (what runtime.engine.ort.Engine allocates), tactic timing uses small opt shapes
    per_sequence = -(-limits.max_seq_len // limits.block_size)
    assert sizes.num_blocks >= per_sequence and sizes.num_slots == limits.max_batch
    assert profile_range("kda_state.0", 0, "S", limits, sizes) == (1, 4, limits.max_batch)
    assert profile_range("mla_cache.3", 0, "NB", limits, sizes) == (1, 256, sizes.num_blocks)
    assert profile_range("mla_cache.3", 1, "BS", limits, sizes) == (limits.block_size,) * 3
    assert profile_range("block_tables", 1, "B", limits, sizes) == (1, 64, per_sequence)
    assert profile_range("input_ids", 0, "T", limits, sizes) == (1, 256, limits.max_num_tokens)
    with pytest.raises(InputError, match="unknown symbolic dimension"):
        profile_range("x", 0, "Q", limits, sizes)


def test_gathered_logits_width_recovered(tiny_graphs):  # noqa: F811
    model = onnx.load(str(tiny_graphs[0]), load_external_data=False)
    dims = segment_input_dims(model, _value_types(model), Mapping(4, 1, 2, 2))
    vocab = next(d.dim_value for o in model.graph.output if o.name == "logits" for d in o.type.tensor_type.shape.dim[1:])
    assert dims["lm_head.all_gather"] == ["N", vocab]


def test_builder_without_tensorrt_is_a_clear_error(tmp_path):
    assert importlib.util.find_spec("tensorrt") is None
    recipe, _ = load_recipe("h100x64.yaml")
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        build_tensorrt_engine(tmp_path / "model.onnx", recipe, Mapping(64, 0, 8, 64), tmp_path / "rank0.engine")
    assert not any(tmp_path.iterdir())


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
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert types["logits"] == onnx.TensorProto.FLOAT

    def cast_weights(model):
        inits = {t.name: t for t in model.graph.initializer}
        return {n.input[0]: inits[n.input[0]] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in inits}

    gpu_casts = cast_weights(gpu)
    assert {classify_tensor_name(n) for n in gpu_casts} <= {"router", "norms", "attn_res", "mla", "indexer", "latent_proj"}
    assert all(len(t.dims) == 1 or classify_tensor_name(n) in ("router", "attn_res") for n, t in gpu_casts.items())
    cpu_casts = cast_weights(onnx.load(str(cpu_path), load_external_data=False))
    bf16 = [t.name for t in gpu.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16 and t.dims]
    assert set(bf16) <= set(cpu_casts) and len(bf16) > len(gpu_casts)
    # activations between layers and the collectives are bf16; gates, state and plugin fp32 inputs stay fp32
    reduces = [n for n in gpu.graph.node if n.op_type == "AllReduce"]
    assert reduces and all(types[n.output[0]] == onnx.TensorProto.BFLOAT16 for n in reduces)
    for n in gpu.graph.node:
        if n.op_type == "GatedDeltaScan":
            assert [types.get(i) for i in n.input[:5]] == [16, 16, 16, 1, 1]


def test_gpu_graph_updates_every_pool_in_place(tiny_graphs):  # noqa: F811
    """TensorRT graphs update every state pool inside the engine: GatedDeltaScan / ShortConv take the pool itself
    with the step's slot ids, one PagedCacheWrite per cache pool stores the new rows, and each pool's plugin output
    (aliased to the pool on TensorRT) is itself the graph output `<pool>.written` (pool shape and dtype, caches
    here fp8 uint8 rows; no Identity copy, no Gather of the slots), emitted by the segment that holds it so the
    runtime can bind it to the pool; no `<pool>.out` is returned. CPU graphs return the step's state and rows."""
    from moe_export.graphs.onnx_export import WRITTEN_SUFFIX

    cpu, gpu = (onnx.load(str(p), load_external_data=False) for p in (tiny_graphs[1], tiny_graphs[2]))
    pools = {v.name: v for v in gpu.graph.input if v.name.startswith(("kda_state.", "conv_state.", "mla_cache.", "index_cache."))}
    assert {n.split(".")[0] for n in pools} == {"kda_state", "conv_state", "mla_cache", "index_cache"}
    producers = {o: n for n in gpu.graph.node for o in n.output}
    outputs = {o.name: o for o in gpu.graph.output}
    expected_op = {"kda_state": ("GatedDeltaScan", 5), "conv_state": ("ShortConv", 2), "mla_cache": ("PagedCacheWrite", 0),
                   "index_cache": ("PagedCacheWrite", 0)}  # op, input index of the pool (the aliased input)
    for name, pool in pools.items():
        node = producers[name + WRITTEN_SUFFIX]
        op, pool_input = expected_op[name.split(".")[0]]
        assert node.op_type == op and node.input[pool_input] == name
        assert outputs[name + WRITTEN_SUFFIX].type == pool.type and name + ".out" not in outputs
        if op != "PagedCacheWrite":
            assert node.input[-1] == "slot_ids"
        else:
            assert pool.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert not any(n.op_type == "Gather" and n.input[0] in pools for n in gpu.graph.node)
    segment_outputs = {o for s in plan_segments(gpu) if not isinstance(s, dict) for o in s.outputs}
    assert {name + WRITTEN_SUFFIX for name in pools} <= segment_outputs
    assert not any(n.op_type == "PagedCacheWrite" for n in cpu.graph.node)
    cpu_pools = [v.name for v in cpu.graph.input if v.name.startswith(("kda_state.", "mla_cache."))]
    assert cpu_pools and {o.name for o in cpu.graph.output} >= {name + ".out" for name in cpu_pools}

"""TensorRT backend: one engine per rank, its collectives inside as plugins, packed into `rank{N}.engine`.

Layout (as TensorRT-LLM builds engines). Each rank's exported `model.onnx` is parsed whole into one network:
the `AllReduce` / `AllGather` nodes (and in the dp layout `MoEDispatch` / `MoECombine`, whose receive buffers
have the static bound the graph carries) become plugins (`plugins/collectives/tensorrt_plugin.py`) that do nothing
while the engine is being built (`plugins.collectives.nccl.building()` around `build_serialized_network`;
contract PLUGIN_RUNS_WHILE_BUILDING) and run NCCL at execution with the communicator the runner registers
(from MPI). So ranks build independently, a step is one enqueue, and the ONNX Runtime backend keeps its
segments (`export/backends/onnxruntime.py`). The vocab gather stays where it is cheapest: after the last-token
rows and the lm_head, [N, V/tp] per rank.

Placement. The build runs on the GPU of its local rank (`plugins.tensorrt_runtime.select_device`), so ranks of
one node under mpiexec build on their own GPUs; `recipe.tensorrt.prefer_aot` picks AOT or JIT plugins, and the AOT
kernels are cubins for the recipe's GPU (`plugins/tensorrt_target.py`; PTX only as a fallback).

Memory. The build refuses a recipe whose per-GPU total (weights, pools for max_batch sequences with at least
one max_seq_len, activation memory, plugin workspaces, reserve; `export/plan/planner.py`) does not fit, before
parsing. Then, before the whole rank is built, a probe engine of its first layers (`probe_graph`: up to the first
layer of each kind, KDA, MLA and MoE; 4 of K3's 93) is built with the same profile and settings and its activation
memory (`device_memory_size_v2`, contract USER_MANAGED_DEVICE_MEMORY) checked against the plan: a probe over
budget means the engine is (contract PROBE_MEMORY_BOUNDS_THE_ENGINE_BELOW), found in minutes rather than
after the rank's whole build (its tactics land in the timing cache the whole build then reads). After the build
the engine's own activation memory (it includes the MoE and indexer plugins' workspace outputs, and the head) is
checked the same way. The builder's workspace limit is that budget too.

File. `rank{N}.engine` is a safetensors file (`common/engine_file.py`; never pickle): one uint8 tensor `engine`
holding TensorRT's serialized engine, and in the metadata `trt_engine` (JSON: rank, input and output names, the
optimization profile [min, opt, max] of every input, `pool_limits` (the most state slots and cache blocks the
runner may allocate: the planner's pool sizes, slots plus the decode graphs' padding slot), the engine's device
memory and layer count, prefer_aot) and `tensorrt_version`.

Builder settings, each for a reason:
  - STRONGLY_TYPED network: the graph's own types decide precision (no implicit fp16/int8).
  - PREFER_JIT_PYTHON_PLUGINS (default) or PREFER_AOT_PYTHON_PLUGINS: GatedDeltaScan, ShortConv and
    SparseMLAAttention define both implementations, and QDP refuses to choose.
  - no aliased plugin I/O (PreviewFeature.ALIASED_PLUGIN_IO_10_03 stays off): no pool is a network input or
    output; the plugins reach the runner's pools through the `pool_table` input (contract
    ALIASED_PLUGIN_IO_MAY_COPY: TensorRT "may insert copies" for aliased plugin I/O).
  - one optimization profile from the recipe's limits (`profile_range`): token and sequence dims from 1 to
    their maxima, the block-table width B from 1 to one max_seq_len sequence's blocks; the pools are not engine
    inputs, so tactic timing never allocates them.
Supported: TensorRT 10.9+ (AOT plugins, network preference flags), any NumPy (see plugins/tensorrt_common.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
from moe_export.common.atomic import atomic_path
from moe_export.common.engine_file import (
    ENGINE_KEY,
    EngineFileWriter,
    read_engine_file,
    stream_reader,
    stream_writer,
)
from moe_export.common.errors import InputError
from moe_export.export.plan.planner import GIB, make_plan
from moe_export.plugins.collectives.onnx_schema import COLLECTIVE_OPS
from moe_export.plugins.tensorrt_runtime import import_tensorrt, register_plugins, select_device
from moe_export.plugins.tensorrt_target import GPU_CAPABILITY, set_target_capability

DECODE_PAD_SLOTS = 1  # the runner's decode CUDA graphs pad batches onto one spare recurrent-state slot
ENGINE_WORKSPACES = ("moe_mxfp4", "dsa_indexer", "moe_all_to_all")  # planner parts that are plugin outputs


def profile_range(name: str, axis: int, dim: str | int, limits, pools) -> tuple[int, int, int]:
    """(min, opt, max) of one dimension of an engine input: a fixed size, or a symbolic name.

    T tokens of the step (M of them image rows); N sequences (N_plus_1 = cu_seqlens); B blocks per block table,
    at most the blocks of one max_seq_len sequence within the planner's pool (`pools`, its `PoolSizes`), with a
    small opt value. The pools themselves are no engine input (the `pool_table` [P, 3] is fixed)."""
    if isinstance(dim, int):
        return dim, dim, dim
    tokens = limits.max_num_tokens
    per_sequence = min(-(-limits.max_seq_len // pools.block_size), pools.num_blocks)
    ranges = {
        "T": (1, min(tokens, 256), tokens),
        "M": (0, min(tokens, 64), tokens),  # the step's image rows (K3 with a vision tower), at most its tokens
        "N": (1, limits.max_batch, limits.max_batch),
        "N_plus_1": (2, limits.max_batch + 1, limits.max_batch + 1),
        "B": (1, min(per_sequence, 64), per_sequence),
    }
    if dim not in ranges:
        raise InputError(f"engine input {name!r} axis {axis}: unknown symbolic dimension {dim!r}")
    return ranges[dim]


def graph_input_dims(model: onnx.ModelProto) -> dict[str, list]:
    """Dimensions (int or symbolic name) of every input of a rank graph (every dynamic dim is named)."""
    out = {}
    for vi in model.graph.input:
        dims = []
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                raise InputError(f"graph input {vi.name!r} axis {axis}: unnamed dynamic dimension")
        out[vi.name] = dims
    return out


def engine_profile(model: onnx.ModelProto, recipe) -> dict[str, list[list[int]]]:
    """{input: [min dims, opt dims, max dims]} of the engine's one optimization profile."""
    pools = make_plan(recipe).pool_sizes()  # what the runtime allocates on every rank
    profile = {}
    for name, dims in graph_input_dims(model).items():
        ranges = [profile_range(name, axis, d, recipe.limits, pools) for axis, d in enumerate(dims)]
        profile[name] = [[r[j] for r in ranges] for j in range(3)]
    return profile


def check_fits(recipe, rank: int) -> dict:
    """The planner's per-GPU memory of `rank`; an InputError when the recipe does not fit (weights, pools for
    one max_seq_len sequence and max_batch slots, activations, plugin workspaces and reserve)."""
    plan = make_plan(recipe)
    if not plan.fits:
        raise InputError(f"recipe {recipe.name}: {plan.verdict()}")
    return plan.per_rank[rank].memory


def _checked(ok, what: str) -> None:
    if not ok:
        raise InputError(f"TensorRT: {what} failed (see the TensorRT log above)")


def parse_network(trt, builder, logger, graph_path: Path, rank: int, prefer_aot: bool):
    """(network, parser) of the rank graph: STRONGLY_TYPED, the recipe's AOT / JIT plugin preference."""
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    prefer = "PREFER_AOT_PYTHON_PLUGINS" if prefer_aot else "PREFER_JIT_PYTHON_PLUGINS"
    flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, prefer))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph_path)):  # external weights resolve next to the graph
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise InputError(f"{graph_path}: TensorRT could not parse rank {rank}'s graph: {errors}")
    return network, parser


PROBE_GRAPH = "probe.onnx"  # written beside the rank graph (its initializers point into the same weights file)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def probe_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rank graph's first layers as a graph of their own: layers 0..k, k the first layer by which every layer
    plugin of the graph (KDA, MLA, MoE, ...) has appeared; the nodes that need a later layer dropped, every tensor
    of the kept part that a later layer reads an output (the residual stream, its snapshots, the last collective),
    then only what those outputs need kept (the head goes). Types of the outputs from ONNX shape inference; initializers stay external."""
    from moe_export.plugins.registry import register_all_schemas

    register_all_schemas()
    nodes = list(model.graph.node)
    layer_of = [int(m.group(1)) if (m := _LAYER.search(n.name)) else None for n in nodes]
    kinds: dict[int, set[str]] = {}
    for node, layer in zip(nodes, layer_of):
        if layer is not None and node.domain and node.op_type not in COLLECTIVE_OPS:
            kinds.setdefault(layer, set()).add(node.op_type)
    every, seen, last = set().union(*kinds.values()), set(), max(kinds)
    for layer in sorted(kinds):
        seen |= kinds[layer]
        if seen == every:
            last = layer
            break
    dropped_tensors: set[str] = set()
    kept: list[onnx.NodeProto] = []
    for node, layer in zip(nodes, layer_of):  # topological order: a node needing a dropped tensor is dropped
        if (layer is not None and layer > last) or any(i in dropped_tensors for i in node.input):
            dropped_tensors.update(node.output)
        else:
            kept.append(node)
    produced = {o for n in kept for o in n.output}
    crossing = sorted({i for n, layer in zip(nodes, layer_of) if layer is not None and layer > last
                       for i in n.input if i in produced})  # what the later layers read of the kept part
    needed, closure = set(crossing), []
    for node in reversed(kept):  # only what the outputs need
        if any(o in needed for o in node.output):
            closure.append(node)
            needed.update(node.input)
    closure.reverse()
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    outputs = []
    for name in crossing:
        if name not in types:
            raise InputError(f"probe graph: no type for {name!r}, which crosses from layer {last} to the next")
        outputs.append(onnx.ValueInfoProto(name=name, type=types[name]))
    graph = onnx.helper.make_graph(
        closure, f"{model.graph.name}.probe", [v for v in model.graph.input if v.name in needed], outputs,
        [t for t in model.graph.initializer if t.name in needed])
    probe = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    probe.metadata_props.extend(model.metadata_props)
    probe.metadata_props.add(key="probe_layers", value=str(last + 1))
    return probe


def probe_memory(trt, builder, logger, graph_path: Path, recipe, mapping, memory: dict, prefer_aot: bool,
                 cache_path: Path) -> int:
    """Build the probe engine of the rank's first layers (`probe_graph`) and return its activation memory; an
    InputError when it is already more than the plan set aside for the whole engine."""
    from moe_export.plugins.collectives.nccl import building

    model = onnx.load(str(graph_path), load_external_data=False)
    probe = probe_graph(model)
    path = graph_path.with_name(PROBE_GRAPH)
    path.write_bytes(probe.SerializeToString())
    layers = next(p.value for p in probe.metadata_props if p.key == "probe_layers")
    network, parser = parse_network(trt, builder, logger, path, mapping.rank, prefer_aot)
    config, timing_cache = builder_config(trt, builder, network, memory["activations"] + memory["plugin_workspaces"],
                                          engine_profile(probe, recipe), cache_path)  # fmt: skip
    plan = path.with_suffix(".engine")
    with EngineFileWriter(plan) as sink:  # streamed to disk and back as the whole engine is (ENGINE_STREAMS)
        with building():
            _checked(serialize_engine(trt, builder, network, config, sink),
                     f"building rank {mapping.rank}'s probe engine ({layers} layers)")
        sink.flush()
        del network, parser
        engine = trt.Runtime(logger).deserialize_cuda_engine(stream_reader(trt, plan, sink.data_offset, sink.size))
        _checked(engine is not None, "deserializing the probe engine")
        device_memory = int(engine.device_memory_size_v2)
        del engine
    cache_path.write_bytes(bytes(timing_cache.serialize()))  # the whole build reuses the probe's tactics
    path.unlink()
    plan.unlink()
    planned = planned_engine_memory(memory)
    if device_memory > planned:
        raise InputError(
            f"recipe {recipe.name}: rank {mapping.rank}'s first {layers} layers alone need {device_memory / GIB:.2f} "
            f"GiB of activation memory (probe engine), the plan set aside {planned / GIB:.2f} GiB for the whole "
            "engine: lower limits.max_num_tokens (found before building the whole rank)")
    return device_memory


def planned_engine_memory(memory: dict) -> int:
    """The plan's bytes for an engine's device memory: activations and the workspaces that are plugin outputs."""
    return memory["activations"] + sum(memory.get(f"workspace.{k}", 0) for k in ENGINE_WORKSPACES)


def builder_config(trt, builder, network, workspace: int, profile_dims: dict, cache_path: Path):
    """(config, timing cache): the workspace limit, one auxiliary-stream-free stream (contract MAX_AUX_STREAMS:
    each MoE layer's tp all-reduce and ep all-to-all are independent branches, and NCCL needs the same
    collective order on every rank), the timing cache, the one optimization profile."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
    config.max_aux_streams = 0
    timing_cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    _checked(config.set_timing_cache(timing_cache, ignore_mismatch=False), "set_timing_cache")
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        profile.set_shape(name, *profile_dims[name])
    _checked(config.add_optimization_profile(profile) >= 0, "add_optimization_profile")
    return config, timing_cache


def serialize_engine(trt, builder, network, config, sink: EngineFileWriter) -> bool:
    """Build and write the plan into `sink` (contract ENGINE_STREAMS): streamed where the bindings have
    `build_serialized_network_to_stream`, else TensorRT's one IHostMemory written as a buffer (no copy)."""
    if hasattr(builder, "build_serialized_network_to_stream"):
        return bool(builder.build_serialized_network_to_stream(network, config, stream_writer(trt, sink)))
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        return False
    sink.write(memoryview(blob))
    return True


def engine_meta(recipe, mapping, memory: dict, engine, io_names: tuple[list, list], profile_dims: dict,
                prefer_aot: bool) -> dict:
    """The engine file's `trt_engine` metadata; an InputError when the engine needs more activation memory than
    the plan set aside (the MoE and indexer workspaces and the dp layout's all-to-all buffers are plugin
    outputs, so inside the engine's device memory)."""
    device_memory = int(engine.device_memory_size_v2)
    planned = planned_engine_memory(memory)
    if device_memory > planned:
        raise InputError(
            f"recipe {recipe.name}: rank {mapping.rank}'s engine needs {device_memory / GIB:.2f} GiB of activation "
            f"memory, the plan set aside {planned / GIB:.2f} GiB: lower limits.max_num_tokens"
        )
    pools = make_plan(recipe).pool_sizes()
    return {
        "rank": mapping.rank,
        "inputs": io_names[0],
        "outputs": io_names[1],
        "profile": profile_dims,
        "pool_limits": {"slots": pools.num_slots + DECODE_PAD_SLOTS, "blocks": pools.num_blocks},
        "device_memory_bytes": device_memory,
        "num_layers": int(engine.num_layers),
        "prefer_aot": bool(prefer_aot),
    }


def build_tensorrt_engine(graph_path: Path, recipe, mapping, out_path: Path, *, prefer_aot: bool | None = None) -> None:
    """Build `rank{N}.engine` (see the module docstring) from the exported graph next to its weights.

    A timing cache `<out_path stem>.timing_cache` beside out_path is read if present and rewritten. Host memory:
    the parser's weights while building, the plan streamed to disk (`common/engine_file.py`), then read back by
    chunks to check the engine's device memory."""
    from moe_export.plugins.collectives.nccl import building

    trt = import_tensorrt(recipe.name)
    memory = check_fits(recipe, mapping.rank)
    prefer_aot = recipe.tensorrt.prefer_aot if prefer_aot is None else prefer_aot
    register_plugins()
    set_target_capability(GPU_CAPABILITY.get(recipe.target.gpu))  # AOT kernels: cubin for the target GPU
    select_device()
    graph_path, out_path = Path(graph_path), Path(out_path)
    profile_dims = engine_profile(onnx.load(str(graph_path), load_external_data=False), recipe)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = out_path.with_suffix(".timing_cache")
    probe = probe_memory(trt, builder, logger, graph_path, recipe, mapping, memory, prefer_aot, cache_path)
    network, parser = parse_network(trt, builder, logger, graph_path, mapping.rank, prefer_aot)
    config, timing_cache = builder_config(trt, builder, network, memory["activations"] + memory["plugin_workspaces"],
                                          profile_dims, cache_path)  # fmt: skip
    io_names = ([network.get_input(i).name for i in range(network.num_inputs)],
                [network.get_output(i).name for i in range(network.num_outputs)])  # fmt: skip
    with atomic_path(out_path) as tmp, EngineFileWriter(tmp) as sink:
        with building():  # the collective plugins return at once while TensorRT times tactics
            _checked(serialize_engine(trt, builder, network, config, sink), f"building rank {mapping.rank}'s engine")
        sink.flush()
        del network, parser  # the parser's weights, before the plan is read back
        engine = trt.Runtime(logger).deserialize_cuda_engine(stream_reader(trt, tmp, sink.data_offset, sink.size))
        _checked(engine is not None, "deserializing the engine just built")
        meta = {**engine_meta(recipe, mapping, memory, engine, io_names, profile_dims, prefer_aot),
                "probe_device_memory_bytes": probe}
        sink.finish({ENGINE_KEY: json.dumps(meta, sort_keys=True), "tensorrt_version": trt.__version__})
    with atomic_path(cache_path) as tmp:
        tmp.write_bytes(bytes(timing_cache.serialize()))


def describe_engine(path: Path) -> dict:
    """What a built engine holds (needs TensorRT and the GPU): its layers (TensorRT's engine inspector, JSON),
    device memory and I/O, next to what the build recorded."""
    meta, blob = read_engine_file(path)
    trt = import_tensorrt(str(path))
    register_plugins()
    select_device()
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(blob)
    _checked(engine is not None, f"deserializing {path}")
    inspector = engine.create_engine_inspector()
    layers = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    return {"recorded": meta, "device_memory_bytes": int(engine.device_memory_size_v2),
            "num_layers": int(engine.num_layers), "layers": layers.get("Layers", layers)}  # fmt: skip

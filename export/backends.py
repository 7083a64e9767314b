"""Backends: lowering a rank's exported graph for ONNX Runtime (CPU) or building a TensorRT engine (GPU).

ONNX Runtime lowering. ORT cannot run Python kernels in our domain at useful speed and we have no
ORT C headers here, so each plugin ships its ONNX Runtime kernel as a model-local ONNX function in
standard ops (`plugins/<op>/ort.py`), which ORT inlines. Collectives cannot live inside an ORT
graph, so the graph is split at every `AllReduce` / `AllGather` node into segments; the runtime
runs a segment, performs the collective with MPI (or in process), and feeds the next segment.
Both the segments and the TensorRT build come from the same exported `model.onnx`, which stays as
exported (bare plugin nodes, TensorRT's plugin lookup: op type = plugin name, domain = namespace).

    rank{N}/model.onnx             the exported graph (TensorRT input)
    rank{N}/ort_segment_000.onnx   segments, each referencing rank{N}/weights.safetensors
    rank{N}/ort_plan.json          [{"segment": file, "inputs": [...], "outputs": [...]},
                                    {"collective": op, "group": g, "input": x, "output": y, "axis": a}, ...]
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from moe_export.export.errors import InputError
from moe_export.plugins import DOMAIN
from moe_export.plugins.collectives.onnx_schema import COLLECTIVE_OPS
from moe_export.plugins.registry import ort_function, register_all_schemas

ORT_PLAN = "ort_plan.json"


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types of every value, from the graph's inputs/outputs and (non-strict) shape inference."""
    register_all_schemas()
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=False)
    types = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        types[vi.name] = vi.type
    return types


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    if name in types:
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(types[name])
        return vi
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def split_at_collectives(model: onnx.ModelProto) -> tuple[list[list[onnx.NodeProto]], list[onnx.NodeProto]]:
    """Node lists between collective nodes (in graph order) and the collective nodes themselves."""
    segments: list[list[onnx.NodeProto]] = [[]]
    collectives = []
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type in COLLECTIVE_OPS:
            collectives.append(node)
            segments.append([])
        else:
            segments[-1].append(node)
    return segments, collectives


def lower_for_onnxruntime(graph_path: Path, out_dir: Path) -> list[str]:
    """Write ORT segment graphs + `ort_plan.json` into out_dir; returns the file names written."""
    graph_path, out_dir = Path(graph_path), Path(out_dir)
    model = onnx.load(str(graph_path), load_external_data=False)
    types = _value_types(model)
    segments, collectives = split_at_collectives(model)
    inits = {t.name: t for t in model.graph.initializer}
    graph_outputs = [v.name for v in model.graph.output]

    # Which values each later step consumes: segment inputs, collective inputs, graph outputs.
    consumers_after: list[set[str]] = []
    later: set[str] = set(graph_outputs)
    steps = []
    for k in range(len(segments)):
        steps.append(("segment", segments[k]))
        if k < len(collectives):
            steps.append(("collective", collectives[k]))
    for kind, item in reversed(steps):
        consumers_after.append(set(later))
        if kind == "segment":
            for node in item:
                later.update(i for i in node.input if i)
        else:
            later.add(item.input[0])
    consumers_after.reverse()

    plan: list[dict] = []
    written: list[str] = []
    seg_index = 0
    for (kind, item), needed_later in zip(steps, consumers_after):
        if kind == "collective":
            entry = {"collective": item.op_type, "input": item.input[0], "output": item.output[0]}
            for a in item.attribute:
                if a.name in ("group", "axis"):
                    entry[a.name] = helper.get_attribute_value(a)
                    if isinstance(entry[a.name], bytes):
                        entry[a.name] = entry[a.name].decode()
            plan.append(entry)
            continue
        nodes = item
        if not nodes:
            continue
        produced = {o for n in nodes for o in n.output}
        used = [i for n in nodes for i in n.input if i]
        seg_inputs = sorted({i for i in used if i not in produced and i not in inits})
        seg_outputs = sorted(o for o in produced if o in needed_later)
        seg_inits = [inits[i] for i in sorted({i for i in used if i in inits})]
        funcs = []
        for op_type in sorted({n.op_type for n in nodes if n.domain == DOMAIN}):
            funcs.append(ort_function(op_type))
        graph = helper.make_graph(
            nodes, f"{model.graph.name}.segment{seg_index}",
            [_value_info(i, types) for i in seg_inputs], [_value_info(o, types) for o in seg_outputs], seg_inits,
        )
        seg = helper.make_model(graph, opset_imports=list(model.opset_import), functions=funcs,
                                producer_name="moe-export")
        seg.ir_version = model.ir_version
        name = f"ort_segment_{seg_index:03d}.onnx"
        (out_dir / name).write_bytes(seg.SerializeToString(deterministic=True))
        written.append(name)
        plan.append({"segment": name, "inputs": seg_inputs, "outputs": seg_outputs})
        seg_index += 1
    (out_dir / ORT_PLAN).write_text(json.dumps({"steps": plan, "graph_outputs": graph_outputs}, indent=1,
                                               sort_keys=True))
    written.append(ORT_PLAN)
    return written


def _profile_range(name: str, axis: int, dim: int, limits, pools) -> tuple[int, int, int]:
    """(min, opt, max) of one input dimension for the optimization profile; `pools` is the engine's
    `planner.PoolSizes` (the same arithmetic the planner and the engine loader use)."""
    if dim >= 0:
        return dim, dim, dim
    if axis == 0 and name in ("input_ids", "positions"):
        return 1, min(limits.max_num_tokens, 256), limits.max_num_tokens
    if axis == 0 and name in ("slot_ids", "last_token_index", "block_tables"):
        return 1, limits.max_batch, limits.max_batch
    if name == "cu_seqlens":
        return 2, limits.max_batch + 1, limits.max_batch + 1
    if name == "block_tables":  # blocks of the longest sequence
        most = -(-limits.max_seq_len // pools.block_size)
        return 1, most, most
    if name.startswith(("mla_cache.", "index_cache.")):  # paged pools [num_blocks, block_size, D]
        size = pools.num_blocks if axis == 0 else pools.block_size
        return size, size, size
    return pools.num_slots, pools.num_slots, pools.num_slots  # recurrent-state pools: one slot per sequence


def build_tensorrt_engine(graph_path: Path, recipe, mapping, out_path: Path) -> None:
    """Build `rank{N}.engine` from the exported graph with our plugins registered (needs TensorRT >= 10.9).

    Not exercised here: TensorRT is not installable on these machines (see README)."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise InputError(
            f"recipe {recipe.name}: backend 'tensorrt' needs the TensorRT Python package (import failed: {exc}); "
            "install TensorRT >= 10.9 on a GPU machine, or use backend: onnxruntime"
        ) from None
    from moe_export.plugins.registry import OP_FOLDERS
    import importlib

    for folder in sorted(set(OP_FOLDERS.values())):
        importlib.import_module(f"moe_export.plugins.{folder}.tensorrt_plugin")  # registers the QDP plugins
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    parser.set_flag(trt.OnnxParserFlag.NATIVE_INSTANCENORM)
    if not parser.parse_from_file(str(graph_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise InputError(f"{graph_path}: TensorRT could not parse the graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(recipe.workspace_reserve_gib * 2**30))
    limits = recipe.limits
    from moe_export.export.planner import make_plan

    pools = make_plan(recipe).pool_sizes()  # what the runtime allocates on every rank
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        ranges = [_profile_range(tensor.name, axis, d, limits, pools) for axis, d in enumerate(tensor.shape)]
        profile.set_shape(tensor.name, *(list(r[j] for r in ranges) for j in range(3)))
    config.add_optimization_profile(profile)
    cache_path = Path(out_path).with_suffix(".timing_cache")
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise InputError(f"{graph_path}: TensorRT engine build failed for rank {mapping.rank} (see the log above)")
    Path(out_path).write_bytes(bytes(engine))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))

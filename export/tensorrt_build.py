"""TensorRT backend: one engine per segment of a rank's exported graph, packed into `rank{N}.engine`.

Collectives. The graph is cut at its `AllReduce` / `AllGather` nodes exactly as for ONNX Runtime
(`backends.plan_segments`); each segment becomes a TensorRT engine and the runtime performs the collective
between segments with NCCL (`runtime/engine/tensorrt.py`). Chosen over a collective inside the engine because
(1) TensorRT's native `IDistCollectiveLayer` needs 10.16+, gathers only along dimension 0 (the vocab-parallel
logits gather along the last one) and takes its NCCL communicator on the execution context, and a Python
NCCL plugin would run during the build's tactic timing, hanging unless every rank builds in lockstep;
(2) this way ranks build independently, the plan is the one the CPU backend runs and tests, and the
collectives need no Python inside an engine. The price: one enqueue per segment (two to three per layer).

File. `rank{N}.engine` is a safetensors file (safetensors only, never pickle): one uint8 tensor per segment
engine (`segment.000`, ...) holding TensorRT's serialized engine, and in the metadata `trt_plan` (JSON: the
steps as in `ort_plan.json`, segments named by their tensor) and `tensorrt_version`.

Builder settings, each for a reason:
  - STRONGLY_TYPED network: the graph's own types decide precision (no implicit fp16/int8).
  - PREFER_JIT_PYTHON_PLUGINS (default) or PREFER_AOT_PYTHON_PLUGINS: GatedDeltaScan, ShortConv and
    SparseMLAAttention define both implementations, and QDP refuses to choose.
  - PreviewFeature.ALIASED_PLUGIN_IO_10_03: without it TensorRT ignores the in-place (aliased) pool outputs
    of GatedDeltaScan / ShortConv and hands fresh buffers in which only the addressed slots are written.
  - one optimization profile per segment from the recipe's limits (`profile_range`): token and sequence
    dims from 1 to their maxima, pool dims (slots S, cache blocks NB, table width B) from 1 to the runtime's
    pool sizes with small opt values, so the build never allocates full-size pools while timing tactics.
Supported: TensorRT 10.9+ (AOT plugins, network preference flags), any NumPy (see plugins/tensorrt_common.py).
NOT RUN HERE: TensorRT's libraries are not installable on this project's machines; what is checked on CPU is
listed in the README's backend section.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import onnx

from moe_export.export.atomic import atomic_path
from moe_export.export.backends import Segment, _value_types, plan_segments, segment_model
from moe_export.export.errors import InputError
from moe_export.export.planner import make_plan
from moe_export.plugins.registry import OP_FOLDERS

PLAN_KEY = "trt_plan"
MIN_TENSORRT = (10, 9)
TENSORRT_PLUGIN_FOLDERS = sorted(set(OP_FOLDERS.values()) - {"collectives"})  # collectives: between engines


def import_tensorrt(recipe_name: str):
    """The `tensorrt` module (>= 10.9), or an InputError saying what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise InputError(
            f"recipe {recipe_name}: backend 'tensorrt' needs the TensorRT Python package (import failed: {exc}); "
            "install TensorRT >= 10.9 on a GPU machine, or use backend: onnxruntime"
        ) from None
    version = tuple(int(x) for x in trt.__version__.split(".")[:2])
    if version < MIN_TENSORRT:
        raise InputError(f"recipe {recipe_name}: TensorRT {trt.__version__} is too old; the plugins need >= 10.9")
    return trt


def register_plugins() -> None:
    """Import every plugin folder's `tensorrt_plugin` module (each registers its QDP plugin on import)."""
    for folder in TENSORRT_PLUGIN_FOLDERS:
        importlib.import_module(f"moe_export.plugins.{folder}.tensorrt_plugin")


def profile_range(name: str, axis: int, dim: str | int, limits, pools) -> tuple[int, int, int]:
    """(min, opt, max) of one dimension of a segment input: a fixed size, or a symbolic name.

    T tokens of the step (M of them image rows); N sequences (N_plus_1 = cu_seqlens); pools: S recurrent-state slots, NB cache blocks
    of BS positions, B blocks per block table, with maxima the runtime's pool sizes (`pools`, the planner's
    `PoolSizes`: the same arithmetic as the planner and the engine loader) and small opt values, so the build's
    tactic timing never allocates full-size pools."""
    if isinstance(dim, int):
        return dim, dim, dim
    tokens = limits.max_num_tokens
    per_sequence = min(-(-limits.max_seq_len // pools.block_size), pools.num_blocks)
    pools = {"S": pools.num_slots, "BS": pools.block_size, "B": per_sequence, "NB": pools.num_blocks}
    ranges = {
        "T": (1, min(tokens, 256), tokens),
        "M": (0, min(tokens, 64), tokens),  # the step's image rows (K3 with a vision tower), at most its tokens
        "N": (1, limits.max_batch, limits.max_batch),
        "N_plus_1": (2, limits.max_batch + 1, limits.max_batch + 1),
        "S": (1, min(pools["S"], 4), pools["S"]),
        "BS": (pools["BS"], pools["BS"], pools["BS"]),
        "B": (1, min(pools["B"], 64), pools["B"]),
        "NB": (1, min(pools["NB"], 256), pools["NB"]),
    }
    if dim not in ranges:
        raise InputError(f"segment input {name!r} axis {axis}: unknown symbolic dimension {dim!r}")
    return ranges[dim]


def segment_input_dims(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], mapping) -> dict[str, list]:
    """Dimensions (int or symbolic name) of every value that crosses a segment boundary.

    ONNX shape inference leaves some dims unnamed: a collective's gathered axis (recovered from its input and
    the group size), `local_slots` = Range(0, N), and the token dim of `Reshape(x, [-1, heads, dim])` outputs
    (in our graphs every other unnamed leading dim counts tokens, so axis 0 reads as T)."""
    steps = plan_segments(model)
    gathered = {s["output"]: s for s in steps if isinstance(s, dict)}

    def dims_of(name: str) -> list:
        out = []
        for axis, d in enumerate(types[name].tensor_type.shape.dim):
            if d.HasField("dim_value"):
                out.append(d.dim_value)
            elif d.dim_param and not d.dim_param.startswith("unk__"):
                out.append(d.dim_param)
            elif name in gathered and gathered[name]["collective"] == "AllGather":
                step = gathered[name]
                src = dims_of(step["input"])
                size = mapping.tp if step["group"] == "tp" else mapping.ep
                out.append(src[axis] * size if axis % len(src) == step["axis"] % len(src) else src[axis])
            elif axis == 0:
                out.append("N" if name == "local_slots" else "T")
            else:
                raise InputError(f"value {name!r} axis {axis}: dimension unknown after shape inference")
        return out

    return {i: dims_of(i) for s in steps if isinstance(s, Segment) for i in s.inputs}


def _build_segment(trt, builder, logger, model: onnx.ModelProto, segment: Segment, types, input_dims: dict,
                   graph_dir: Path, recipe, timing_cache, prefer_aot: bool) -> bytes:  # fmt: skip
    """Serialized engine of one segment (its ONNX file is written next to the weights, parsed, removed)."""
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    prefer = "PREFER_AOT_PYTHON_PLUGINS" if prefer_aot else "PREFER_JIT_PYTHON_PLUGINS"
    flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, prefer))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    onnx_path = graph_dir / f".trt_segment_{segment.index:03d}.onnx"
    onnx_path.write_bytes(segment_model(model, segment, types).SerializeToString(deterministic=True))
    try:
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise InputError(f"{onnx_path.name}: TensorRT could not parse segment {segment.index}: {errors}")
    finally:
        onnx_path.unlink()
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(recipe.workspace_reserve_gib * 2**30))
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    pools = make_plan(recipe).pool_sizes()  # what the runtime allocates on every rank
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = input_dims[tensor.name]
        ranges = [profile_range(tensor.name, axis, d, recipe.limits, pools) for axis, d in enumerate(dims)]
        profile.set_shape(tensor.name, *([r[j] for r in ranges] for j in range(3)))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise InputError(f"segment {segment.index}: TensorRT engine build failed (see the log above)")
    return bytes(engine)


def build_tensorrt_engine(graph_path: Path, recipe, mapping, out_path: Path, *, prefer_aot: bool = False) -> None:
    """Build `rank{N}.engine` (see the module docstring) from the exported graph next to its weights.

    A timing cache `<out_path stem>.timing_cache` beside out_path is read if present and rewritten."""
    from safetensors.numpy import save_file

    trt = import_tensorrt(recipe.name)
    register_plugins()
    graph_path, out_path = Path(graph_path), Path(out_path)
    model = onnx.load(str(graph_path), load_external_data=False)
    types = _value_types(model)
    input_dims = segment_input_dims(model, types, mapping)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = out_path.with_suffix(".timing_cache")
    probe = builder.create_builder_config()
    timing_cache = probe.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    engines: dict[str, np.ndarray] = {}
    steps: list[dict] = []
    for step in plan_segments(model):
        if isinstance(step, dict):
            steps.append(step)
            continue
        name = f"segment.{step.index:03d}"
        blob = _build_segment(trt, builder, logger, model, step, types, input_dims, graph_path.parent, recipe,
                              timing_cache, prefer_aot)
        engines[name] = np.frombuffer(blob, dtype=np.uint8)
        steps.append({"segment": name, "inputs": step.inputs, "outputs": step.outputs})
    plan = {"steps": steps, "graph_outputs": [v.name for v in model.graph.output], "rank": mapping.rank}
    metadata = {PLAN_KEY: json.dumps(plan, sort_keys=True), "tensorrt_version": trt.__version__}
    with atomic_path(out_path) as tmp:
        save_file(engines, str(tmp), metadata=metadata)
    with atomic_path(cache_path) as tmp:
        tmp.write_bytes(bytes(timing_cache.serialize()))

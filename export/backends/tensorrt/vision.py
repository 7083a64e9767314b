"""TensorRT backend for K3's vision tower: `vision.onnx` built into `vision.engine`, one engine every rank loads.

The tower has no collectives and the same weights on every rank (it is replicated: each rank of an attention
group encodes its share of a request's images, `runtime.engine.vision.encode_spread`), so one build serves
every rank: the file is the same for all of them, and each rank deserializes its own copy on its own GPU
(TensorRT engines are specific to the GPU model, which a recipe's ranks share: `target.gpu`). It is built the
way the text graphs are (`export/backends/tensorrt/engine.py`): the whole graph parsed into one STRONGLY_TYPED network
(the graph's fp32 decides the precision), one optimization profile, the builder's workspace limit and a
device-memory check against the planner's budget, the same `trt_engine` safetensors file format.

Profile (`vision_profile`): L patches of the rank's images (pixel_values, pos_index, pos_weight, rope_cos /
rope_sin rows), N_plus_1 = images + 1 (cu_seqlens) and M merged tokens (merge_index, image_embeds), from one
4-patch image to ceil(limits.max_images_per_request / tp) images at the patch limit (`image_patch_limit`).
Memory: the engine's device memory must fit the planner's `vision_activation_bytes` (counted without
materialized attention scores, as a fused attention runs on a GPU); an engine that needs more is refused,
naming limits.max_image_patches.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from moe_export.common.atomic import atomic_path
from moe_export.common.engine_file import ENGINE_KEY, EngineFileWriter, stream_reader
from moe_export.common.errors import InputError
from moe_export.export.plan.planner import GIB, image_patch_limit, vision_activation_bytes
from moe_export.export.backends.tensorrt.engine import (
    _checked,
    graph_input_dims,
    import_tensorrt,
    select_device,
    serialize_engine,
)


def vision_profile(model: onnx.ModelProto, recipe, cfg) -> dict[str, list[list[int]]]:
    """{input: [min dims, opt dims, max dims]} of the tower engine's one optimization profile."""
    per_rank = -(-recipe.limits.max_images_per_request // recipe.parallel.tp)
    patches = image_patch_limit(cfg, recipe)
    ranges = {
        "L": (4, min(patches, 4096), per_rank * patches),
        "N_plus_1": (2, 2, per_rank + 1),
        "M": (1, min(patches, 4096) // 4, per_rank * patches // 4),
    }
    profile = {}
    for name, dims in graph_input_dims(model).items():
        bounds = []
        for axis, d in enumerate(dims):
            if isinstance(d, int):
                bounds.append((d, d, d))
            elif d in ranges:
                bounds.append(ranges[d])
            else:
                raise InputError(f"vision graph input {name!r} axis {axis}: unknown symbolic dimension {d!r}")
        profile[name] = [[b[j] for b in bounds] for j in range(3)]
    return profile


def build_vision_engine(graph_path: Path, recipe, cfg, out_path: Path) -> None:
    """Build `vision.engine` (see the module docstring) from `vision.onnx` next to `vision.safetensors`."""
    trt = import_tensorrt(recipe.name)
    if recipe.limits.max_images_per_request < 1:
        raise InputError(f"recipe {recipe.name}: limits.max_images_per_request is 0: no tower engine to build")
    planned = vision_activation_bytes(cfg, recipe)
    select_device()
    graph_path, out_path = Path(graph_path), Path(out_path)
    profile_dims = vision_profile(onnx.load(str(graph_path), load_external_data=False), recipe, cfg)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph_path)):  # external weights resolve next to the graph
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise InputError(f"{graph_path}: TensorRT could not parse the vision tower graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(planned))
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        profile.set_shape(name, *profile_dims[name])
    _checked(config.add_optimization_profile(profile) >= 0, "add_optimization_profile")
    io_names = ([network.get_input(i).name for i in range(network.num_inputs)],
                [network.get_output(i).name for i in range(network.num_outputs)])  # fmt: skip
    with atomic_path(out_path) as tmp, EngineFileWriter(tmp) as sink:
        _checked(serialize_engine(trt, builder, network, config, sink), "building the vision tower engine")
        sink.flush()
        del network, parser
        engine = trt.Runtime(logger).deserialize_cuda_engine(stream_reader(trt, tmp, sink.data_offset, sink.size))
        _checked(engine is not None, "deserializing the vision tower engine just built")
        device_memory = int(engine.device_memory_size_v2)
        if device_memory > planned:
            raise InputError(
                f"recipe {recipe.name}: the vision tower engine needs {device_memory / GIB:.2f} GiB of activation "
                f"memory, the plan set aside {planned / GIB:.2f} GiB: lower limits.max_image_patches or "
                "limits.max_images_per_request"
            )
        meta = {
            "rank": None,  # every rank loads this engine (the tower is replicated)
            "inputs": io_names[0],
            "outputs": io_names[1],
            "profile": profile_dims,
            "device_memory_bytes": device_memory,
            "num_layers": int(engine.num_layers),
        }
        sink.finish({ENGINE_KEY: json.dumps(meta, sort_keys=True), "tensorrt_version": trt.__version__})

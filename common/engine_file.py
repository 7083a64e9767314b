"""The TensorRT engine file format, shared by the build (writer) and the runners (readers).

`rank{N}.engine` and `vision.engine` are safetensors files (never pickle): one uint8 tensor `ENGINE_TENSOR`
holding TensorRT's serialized engine, and in the metadata `ENGINE_KEY` (JSON: rank, input and output names, the
optimization profile [min, opt, max] of every input, the pool limits, device memory bytes, layer count, ...) and
`tensorrt_version`.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_export.common.errors import InputError

ENGINE_KEY = "trt_engine"  # metadata entry holding the build's JSON description of the engine
ENGINE_TENSOR = "engine"  # the uint8 tensor holding TensorRT's serialized engine
VISION_ENGINE = "vision.engine"  # K3's vision tower engine, one file in the engine directory every rank loads


def rank_engine_name(rank: int) -> str:
    """File name of a rank's engine inside its rank folder."""
    return f"rank{rank}.engine"


def read_engine_file(path: Path) -> tuple[dict, bytes]:
    """(metadata `ENGINE_KEY`, serialized TensorRT engine) of an engine safetensors file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: missing (was this engine built with backend tensorrt?)")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if ENGINE_KEY not in meta:
            raise InputError(f"{path}: not a moe-export TensorRT engine file (no {ENGINE_KEY} metadata; engines "
                             "built before one-engine-per-rank must be rebuilt)")
        if ENGINE_TENSOR not in f.keys():
            raise InputError(f"{path}: no {ENGINE_TENSOR!r} tensor")
        return json.loads(meta[ENGINE_KEY]), f.get_tensor(ENGINE_TENSOR).tobytes()

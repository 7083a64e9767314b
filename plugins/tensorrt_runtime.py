"""TensorRT in a process, for the engine builder and the runner alike: the `tensorrt` module at a version our
plugins support, our plugins registered with it, and this rank's GPU made current (local rank -> device)."""

from __future__ import annotations

import importlib

from moe_export.common.errors import InputError
from moe_export.plugins.registry import OP_FOLDERS

MIN_TENSORRT = (10, 9)
TENSORRT_PLUGIN_FOLDERS = sorted(set(OP_FOLDERS.values()))  # collectives included: inside the engine


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
    """Import every plugin folder's `tensorrt_plugin` module (each registers its QDP plugins on import)."""
    for folder in TENSORRT_PLUGIN_FOLDERS:
        importlib.import_module(f"moe_export.plugins.{folder}.tensorrt_plugin")


def select_device() -> int:
    """Make this rank's GPU (local rank -> device) the current CUDA device; returns its index."""
    import torch
    from moe_export.common.mpi import device_for_local_rank, local_rank

    index = device_for_local_rank(local_rank(), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index

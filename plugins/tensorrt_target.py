"""The GPU architecture the TensorRT AOT plugins compile for (no tensorrt import: the builder sets it first).

`export/backends/tensorrt/engine.py` sets the target's compute capability from the recipe (`target.gpu`) before
building; the plugins' `aot_impl`s compile their Triton kernels for it and hand TensorRT a cubin for that
architecture (no driver JIT at load), PTX only when the compile produced no cubin (contract
QDP_AOT_CODE_PTX_OR_CUBIN).
"""

from __future__ import annotations

GPU_CAPABILITY = {"h100": 90, "h200": 90, "b200": 100}  # recipe target.gpu -> compute capability (sm_XY)
_target = {"capability": None}


def set_target_capability(capability: int | None) -> None:
    _target["capability"] = capability


def target_capability() -> int:
    """The capability set by the builder, else the current GPU's (major * 10 + minor)."""
    if _target["capability"] is not None:
        return _target["capability"]
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor

"""Model runners: one step over a packed batch of sequences on a built engine (`ort.Engine`: ONNX Runtime
segments, CPU; `tensorrt.TensorRTEngine`: TensorRT engines, one GPU per rank; `torch_runner.TorchEngine`: PyTorch
with the plugins' kernels, CPU or one GPU per rank) or on the fp32 PyTorch reference model
(`reference.ReferenceEngine`). Their common input and its validation live in `batch`.

`RUNNERS` is the runner side of the backends: which runner class opens an engine directory built for each
recipe `backend` (the build side is `moe_export.export.backends`, which no runner imports)."""

from __future__ import annotations

import importlib
from pathlib import Path

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError

# recipe backend -> (module, class) of its runner; imported only when an engine of that backend is opened
RUNNERS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("moe_export.runtime.engine.ort", "Engine"),
    "tensorrt": ("moe_export.runtime.engine.tensorrt", "TensorRTEngine"),
    "torch": ("moe_export.runtime.engine.torch_runner", "TorchEngine"),
}


def runner_class(backend: str) -> type:
    """The runner class for engines built for `backend`."""
    if backend not in RUNNERS:
        raise InputError(f"backend {backend!r}: no runner for it in this moe-export (known: {', '.join(RUNNERS)})")
    module, name = RUNNERS[backend]
    return getattr(importlib.import_module(module), name)


def open_engine(engine_dir: str | Path, **kwargs):
    """The runner for an engine directory's backend (`EngineConfig.backend`, `RUNNERS`). kwargs: num_slots,
    num_blocks, threads."""
    return runner_class(EngineConfig.read(engine_dir).backend)(engine_dir, **kwargs)


def model_eos_ids(model_config: dict) -> list[int]:
    """The stop ids of an HF config dict: `eos_token_ids` when present, else `eos_token_id` (int or list)."""
    text = model_config.get("text_config") or {}
    for key in ("eos_token_ids", "eos_token_id"):
        value = model_config.get(key, text.get(key))
        if value is not None:
            return [int(v) for v in value] if isinstance(value, list) else [int(value)]
    return []


def engine_eos_ids(engine) -> list[int]:
    """Every stop id of an engine: the build's `eos_token_ids` (config.json and generation_config.json
    together), else those of its HF config."""
    return list((engine.config.eos_token_ids if engine.config is not None else ()) or model_eos_ids(engine.model_config))

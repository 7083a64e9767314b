"""Model runners: one step over a packed batch of sequences on a built engine (`ort.Engine`: ONNX Runtime
segments, CPU; `tensorrt.TensorRTEngine`: TensorRT engines, one GPU per rank; `torch_runner.TorchEngine`: PyTorch
with the plugins' kernels, CPU or one GPU per rank) or on the fp32 PyTorch reference
model (`reference.ReferenceEngine`). Their common input and its validation live in `batch`."""

from __future__ import annotations

from pathlib import Path

from moe_export.common.engine_config import EngineConfig


def open_engine(engine_dir: str | Path, **kwargs):
    """The runner for an engine directory's backend (`EngineConfig.backend`): `ort.Engine` (ONNX Runtime
    segments), `tensorrt.TensorRTEngine` (TensorRT, import-guarded) or `torch_runner.TorchEngine` (PyTorch).
    kwargs: num_slots, num_blocks, threads."""
    backend = EngineConfig.read(engine_dir).backend
    if backend == "tensorrt":
        from moe_export.runtime.engine.tensorrt import TensorRTEngine

        return TensorRTEngine(engine_dir, **kwargs)
    if backend == "torch":
        from moe_export.runtime.engine.torch_runner import TorchEngine

        return TorchEngine(engine_dir, **kwargs)
    from moe_export.runtime.engine.ort import Engine

    return Engine(engine_dir, **kwargs)

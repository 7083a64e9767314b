"""The TensorRT runner's vision tower: `vision.engine` (`export/backends/tensorrt/vision.py`) on one rank.

Every rank deserializes the one tower engine the build wrote (the tower is replicated) with the runtime of its
text engine, on its GPU, and runs it on the rank's one stream, so a tower call is ordered with the steps
around it. Its execution context is USER_MANAGED (contract USER_MANAGED_DEVICE_MEMORY, as the text engine's)
over its own buffer of the engine's `device_memory_size_v2` (the planner counts one tower call's activations
in the workspace reserve; the build refused an engine needing more). A call binds the tower's inputs (each
shape checked against the engine's profile first: images per rank and the patch limit, contract
PROFILE_BOUNDS), enqueues, copies `image_embeds` [M, hidden] fp32 back and waits for it (the scheduler places
the embeddings in the next steps' inputs). Images are spread over the attention group by
`runtime.engine.vision.encode_spread`, as under ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from moe_export.common.engine_file import read_engine_meta, stream_reader
from moe_export.common.errors import InputError
from moe_export.runtime.engine.tensorrt_bind import bind

OUTPUT = "image_embeds"


class TensorRTTower:
    """`feeds -> image_embeds` over the tower engine on one rank (see the module docstring)."""

    def __init__(self, path: Path, runtime, trt, torch, device, stream) -> None:
        self.meta, offset, size = read_engine_meta(path)
        self._torch, self.device, self.stream = torch, device, stream
        self._engine = runtime.deserialize_cuda_engine(stream_reader(trt, path, offset, size))  # in chunks
        if self._engine is None:
            raise InputError(f"{path}: TensorRT could not deserialize the vision tower engine (version or GPU mismatch?)")
        self._context = self._engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if self._context is None:
            raise RuntimeError("TensorRT could not create an execution context for the vision tower")
        size = int(self._engine.device_memory_size_v2)
        with torch.cuda.stream(stream):
            self._activations = torch.empty((max(size, 1),), dtype=torch.uint8, device=device)
        self._context.set_device_memory(self._activations.data_ptr(), size)

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            inputs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device, non_blocking=True)
                      for k, v in feeds.items()}
            bind(self._context, self.meta, inputs, {})
            out = torch.empty(tuple(self._context.get_tensor_shape(OUTPUT)), dtype=torch.float32, device=self.device)
            if not self._context.set_tensor_address(OUTPUT, out.data_ptr()):
                raise RuntimeError(f"TensorRT refused the address of output {OUTPUT}")
            if not self._context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT failed to enqueue the vision tower (see the log above)")
            host = out.to("cpu", non_blocking=True)
        self.stream.synchronize()  # the scheduler needs the embeddings on the host
        return host.numpy()

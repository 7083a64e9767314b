"""A stand-in of TensorRT's runtime API (IRuntime, ICudaEngine, IExecutionContext) and of torch.cuda on CPU, so the
TensorRT runner's real constructor runs here. Each rule it enforces is a contract of
`moe_export.plugins.tensorrt_contracts` (checked, never assumed by the runner):
  - ENGINE_STREAMS: `deserialize_cuda_engine` takes an `IStreamReaderV2` and pulls the plan in chunks (a short
    read is asked again, 0 bytes aborts), and the plan it gets must be the file's engine bytes;
  - USER_MANAGED_DEVICE_MEMORY: a context made with USER_MANAGED has no activation memory until
    `set_device_memory(ptr, size)` with size >= the engine's `device_memory_size_v2`; enqueueing before is an
    error;
  - PROFILE_BOUNDS / SET_INPUT_SHAPE_RETURNS_BOOL: `set_input_shape` returns False outside the profile the build
    recorded; an enqueue with an input left unshaped or at a null address (an empty one included) is an error.
    (Not modelled: the 256-byte alignment, which host tensors do not have.)
Nothing computes: an enqueue records what it was given. torch runs on CPU: `cpu_torch()` is the real torch with
a recording `cuda` namespace (streams, graphs) and host tensors for "cuda" devices.
"""

from __future__ import annotations

import contextlib
import types

import tensorrt_standin as standin
import torch

USER_MANAGED = "USER_MANAGED"
LOG: list = []  # what the runtime and torch.cuda stand-ins were asked, in order


class ExecutionContext:
    def __init__(self, engine: CudaEngine):
        self.engine, self.memory, self.shapes, self.addresses = engine, None, {}, {}

    def set_device_memory(self, ptr: int, size: int) -> None:
        assert size >= self.engine.device_memory_size_v2, "USER_MANAGED_DEVICE_MEMORY: buffer smaller than needed"
        self.memory = (ptr, size)
        LOG.append(("device_memory", size))

    def set_input_shape(self, name: str, shape) -> bool:
        low, _, high = self.engine.meta["profile"].get(name, (None, None, None))
        if low is None or len(shape) != len(low) or any(not lo <= d <= hi for lo, d, hi in zip(low, shape, high)):
            return False  # PROFILE_BOUNDS, reported by the return value (SET_INPUT_SHAPE_RETURNS_BOOL)
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr  # nullptr resets the tensor to its default state (accepted)
        return True

    def get_tensor_shape(self, name: str):
        assert name == "logits"
        return (self.shapes["last_token_index"][0], self.engine.vocab)

    def execute_async_v3(self, stream_handle: int) -> bool:
        assert self.memory is not None, "USER_MANAGED_DEVICE_MEMORY: enqueue before set_device_memory"
        missing = [n for n in self.engine.meta["inputs"] if n not in self.shapes or not self.addresses.get(n)]
        assert not missing, f"enqueue with inputs not bound: {missing}"
        LOG.append(("enqueue", self.shapes["input_ids"][0], self.shapes.get("slot_ids")))
        return True


class CudaEngine:
    def __init__(self, meta: dict, vocab: int):
        self.meta, self.vocab = meta, vocab
        self.device_memory_size_v2 = meta["device_memory_bytes"]
        self.num_layers = meta.get("num_layers", 1)

    def create_execution_context(self, strategy):
        assert strategy == USER_MANAGED, "the runner gives its contexts their memory (USER_MANAGED)"
        return ExecutionContext(self)

    def get_tensor_dtype(self, name: str):
        return standin.DataType.FLOAT


def runtime_module(expected_plan: bytes, meta: dict, vocab: int) -> types.ModuleType:
    """A `tensorrt` module for the runner: the stand-in core's enums and stream interfaces, and a Runtime whose
    deserialization checks it streamed `expected_plan`."""

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, reader):
            assert isinstance(reader, standin.IStreamReaderV2), "ENGINE_STREAMS: the plan comes through a reader"
            plan, reads = b"", 0
            while len(plan) < len(expected_plan):
                chunk = reader.read(len(expected_plan) - len(plan), 0)
                assert chunk, "ENGINE_STREAMS: a read of 0 bytes aborts the deserialization"
                plan, reads = plan + chunk, reads + 1
            LOG.append(("deserialized", len(plan), reads))
            return CudaEngine(meta, vocab) if plan == expected_plan else None

    trt = types.ModuleType("tensorrt")
    trt.__dict__.update(standin._module_namespace())
    trt.__version__ = standin.PINNED_WHEELS["10.9"].rsplit("-", 1)[1]
    trt.Runtime = Runtime
    trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(USER_MANAGED=USER_MANAGED)
    return trt


class _Stream:
    cuda_stream = 0x5EED

    def __init__(self, device=None):
        pass

    def synchronize(self):
        LOG.append(("synchronize",))


class _Graph:
    def replay(self):
        LOG.append(("replay",))


class _Cuda:
    Stream, CUDAGraph = _Stream, _Graph

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(index) -> None:
        pass

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        yield

    @staticmethod
    @contextlib.contextmanager
    def graph(g, stream=None, capture_error_mode="global"):
        LOG.append(("capture",))
        yield


class _CpuTorch(types.ModuleType):
    """The real torch, with `cuda` the recording namespace above and every device the host."""

    cuda = _Cuda

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args):
        return torch.device("cpu")

    @staticmethod
    def zeros(*shape, pin_memory=False, **kw):
        return torch.zeros(*shape, **kw)

    @staticmethod
    def empty(*shape, pin_memory=False, **kw):
        return torch.empty(*shape, **kw)


def cpu_torch() -> types.ModuleType:
    return _CpuTorch("torch")

"""Running the torch runner's GPU path on a CPU-only torch, for the device-discipline and host-sync tests.

- `fake_cuda()`: FakeTensorMode, so tensors "on" `cuda:1` carry shapes, dtypes and devices but no data, and an op
  mixing devices (cuda:1 with cpu, or with cuda:0) raises FakeTensorDeviceMismatchError as CUDA would. Host
  arithmetic (an op on no fake tensor naming no device but the CPU: `torch.arange(n)`, the runner's checks of its
  numpy inputs) runs for real; a real CPU tensor (not 0-dim) meeting a fake CUDA one is then a device mismatch. A CPU-only
  torch takes a CUDA device guard in its C++ Python-indexing path (`x[i]`, `x[i] = v`), which it lacks, so
  `FakeCudaIndexing` runs that indexing on meta stand-ins of the same shapes and strides (checking the index and
  value tensors are on the indexed tensor's device) and returns a fake tensor of the result's shape on its device
  (the same guard makes it check a `copy_` into a fake CUDA tensor by shapes: a copy may cross devices).
- `ShapeKernels`: the runner's kernel table (`torch_kernels.CUDAKernels`' interface) as its outputs' shapes,
  dtypes and devices, checking every tensor argument is on the pools' device. The Triton kernels themselves
  launch on raw pointers (no device propagation to check); what is checked here is everything around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from moe_export.runtime.engine.torch_kernels import CUDAKernels


class DeviceMismatch(AssertionError):
    """A tensor met a tensor of another device where CUDA would refuse it (or copy it through the host)."""


def _check_same(device: torch.device, what: str, tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device != device:
            raise DeviceMismatch(f"{what}: a tensor on {t.device} with one on {device}")


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _meta_index(idx):
    if isinstance(idx, tuple):
        return tuple(_meta_index(i) for i in idx)
    if isinstance(idx, list):
        return [_meta_index(i) for i in idx]
    return _meta(idx)


def _index_tensors(idx) -> list:
    items = idx if isinstance(idx, (tuple, list)) else (idx,)
    return [i for i in items if isinstance(i, torch.Tensor)]


def _is_host_call(args, kwargs) -> bool:
    """Host arithmetic: an op naming no device but the CPU (nor pinned memory), on no fake tensor (`torch.arange(n)`, the runner's checks
    of its numpy inputs). It runs for real; its result meeting a fake CUDA tensor is then a device mismatch."""
    leaves = pytree.tree_leaves((args, kwargs))
    if kwargs.get("pin_memory"):  # page-locked host memory needs CUDA: a fake CPU tensor stands in
        return False
    if any(isinstance(a, (torch.device, str)) and str(a).startswith(("cuda", "meta")) for a in leaves):
        return False
    return not any(isinstance(t, FakeTensor) for t in leaves)


class FakeCudaIndexing(TorchFunctionMode):
    """Python indexing of fake CUDA tensors (see the module docstring); host arithmetic (`_is_host_call`: the
    runner's checks on its numpy inputs) runs for real, outside fake mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:  # no pinned memory without CUDA: the host tensor stands for it
            return args[0]
        if _is_host_call(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        fake_cuda_self = args and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda"
        if func is torch.Tensor.copy_ and fake_cuda_self:  # an explicit transfer: any source device
            torch.broadcast_shapes(args[1].shape, args[0].shape)
            return args[0]
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and fake_cuda_self:
            x, idx = args[0], args[1]
            _check_same(x.device, "indexing", _index_tensors(idx))
            if func is torch.Tensor.__setitem__:
                _check_same(x.device, "index assignment", [args[2]])
                _meta(x)[_meta_index(idx)] = _meta(args[2]) if isinstance(args[2], torch.Tensor) else args[2]
                return None
            out = _meta(x)[_meta_index(idx)]
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=x.device)
        return func(*args, **kwargs)


class RealFile:
    """A safetensors file read as real CPU tensors while fake mode is on (they then enter it as fake CPU tensors)."""

    def __init__(self, file) -> None:
        self.file = file

    def keys(self):
        return self.file.keys()

    def metadata(self):
        return self.file.metadata()

    def get_tensor(self, name: str) -> torch.Tensor:
        with unset_fake_temporarily():
            return self.file.get_tensor(name)


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[FakeTensorMode]:
    """FakeTensorMode with `FakeCudaIndexing`; numpy arrays (`torch.from_numpy`) and the runner's weight files
    (`torch_model.safe_open`, `torch_vision.load_file`) come in as real CPU tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from moe_export.runtime.engine import torch_model, torch_vision

    def real_load(path):
        with unset_fake_temporarily():
            return load_file(path)

    from_numpy = torch.from_numpy

    def real_from_numpy(array):
        with unset_fake_temporarily():
            return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", real_from_numpy)  # not a torch function: the mode never sees it
    monkeypatch.setattr(torch_model, "safe_open", lambda *a, **k: RealFile(safe_open(*a, **k)))
    monkeypatch.setattr(torch_vision, "load_file", real_load)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, FakeCudaIndexing():
        yield mode


def in_fake_mode(mode: FakeTensorMode, fn, *args):
    """fn(*args) under `mode` in the calling thread (torch's modes are per thread: a step worker enters it too)."""
    with mode, FakeCudaIndexing():
        return fn(*args)


SYNC_METHODS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
                torch.Tensor.numpy: "numpy", torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int",
                torch.Tensor.__float__: "float", torch.Tensor.__index__: "index"}


class HostSyncs(TorchFunctionMode):
    """Counts what makes the host wait for a fake CUDA tensor's value: `item`, `tolist`, `cpu`, `numpy`, `bool` /
    `int` / `float` / index conversions, blocking copies between the device and the host (`to` / `copy_` without
    non_blocking), and `torch.cuda.synchronize` (patched by `count_syncs`). A value read is answered with zeros of
    its shape, so the step runs on and every read is counted. Enter it inside `fake_cuda`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        on_device = isinstance(x, FakeTensor) and x.device.type == "cuda"
        if func in SYNC_METHODS and on_device:
            self.calls.append(SYNC_METHODS[func])
            if func is torch.Tensor.cpu:
                return torch.zeros(x.shape, dtype=x.dtype)
            host = np.zeros(x.shape, dtype=np.int64 if not x.is_floating_point() else np.float32)
            return {torch.Tensor.tolist: host.tolist, torch.Tensor.numpy: lambda: host}.get(func, lambda: 0)()
        if func in (torch.Tensor.to, torch.Tensor.copy_) and not kwargs.get("non_blocking") and self._crosses(func, args,
                                                                                                              kwargs):
            self.calls.append(f"blocking {func.__name__}")
        return func(*args, **kwargs)

    @staticmethod
    def _crosses(func, args, kwargs) -> bool:
        """A copy between a CUDA tensor and the host."""
        if func is torch.Tensor.copy_:
            return {args[0].device.type, args[1].device.type} == {"cuda", "cpu"}
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
        return target is not None and {args[0].device.type, torch.device(target).type} == {"cuda", "cpu"}


@contextlib.contextmanager
def count_syncs(monkeypatch) -> Iterator[HostSyncs]:
    """`HostSyncs` with torch.cuda.synchronize counted too."""
    counter = HostSyncs()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: counter.calls.append("synchronize"))
    with counter:
        yield counter


class ShapeKernels:
    """`CUDAKernels`' interface as output shapes on the pools' device (see the module docstring)."""

    expert_layout = CUDAKernels.expert_layout  # the runner converts the experts on the device at load, as for CUDA

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _args(self, name: str, *tensors) -> None:
        _check_same(self.device, f"kernel {name}", tensors)

    def short_conv(self, x, weight, pool, cu, slots):
        self._args("short_conv", x, weight, pool, cu, slots)
        return torch.empty_like(x)

    def gated_delta_scan(self, q, k, v, g, beta, pool, cu, slots, scale):
        self._args("gated_delta_scan", q, k, v, g, beta, pool, cu, slots)
        return torch.empty_like(v)

    def cache_write(self, pool, rows, cu, tables, positions):
        self._args("cache_write", pool, rows, cu, tables, positions)

    def sparse_mla(self, q, pool, new, cu, tables, positions, indices, *, scale, kv_lora_rank):
        self._args("sparse_mla", q, pool, new, cu, tables, positions, indices)
        return torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float32, device=q.device)

    def dsa_indexer(self, q, weights, pool, new, cu, tables, positions, *, topk):
        self._args("dsa_indexer", q, weights, pool, new, cu, tables, positions)
        return torch.empty(q.shape[0], topk, dtype=torch.int64, device=q.device)

    def moe(self, x, ids, weights, experts, **attrs):
        self._args("moe", x, ids, weights, *experts)
        assert x.dtype == torch.bfloat16, f"kernel moe: x is {x.dtype}, the W4A16 kernel takes bf16"
        return torch.empty_like(x)  # in x's dtype, as `moe_mxfp4_triton`

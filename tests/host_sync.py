"""`no_host_sync()`: fail on any torch call that would make the host wait for the device (on CUDA).

Used on CPU tensors to check code meant to run inside a TensorRT enqueue or a CUDA graph capture: reading a value
back (`item`, `int(t)`, `bool(t)`, `tolist`, `cpu`, `numpy`), or an op whose output size depends on tensor values
(`nonzero`, `unique*`, `masked_select`, boolean-mask indexing, `repeat_interleave` without `output_size`,
`bincount`). torch routes every one of them through `__torch_function__`, so a TorchFunctionMode sees them all.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_READBACK = {"item", "__int__", "__float__", "__bool__", "__index__", "tolist", "cpu", "numpy"}
_DATA_SIZED = {"nonzero", "argwhere", "unique", "unique_consecutive", "_unique2", "masked_select", "bincount"}


class HostSync(AssertionError):
    pass


class no_host_sync(TorchFunctionMode):  # noqa: N801  (used as a context manager)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _READBACK or name in _DATA_SIZED:
            raise HostSync(f"{name}: synchronizes with the device")
        if name == "repeat_interleave" and "output_size" not in kwargs and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            raise HostSync("repeat_interleave with tensor repeats and no output_size: synchronizes")
        if name in ("__getitem__", "__setitem__"):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise HostSync(f"{name} with a boolean mask: output size depends on values")
        return func(*args, **kwargs)

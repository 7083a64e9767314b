"""What the TensorRT QDP plugin modules (`plugins/*/tensorrt_plugin.py`) share; imports tensorrt.

Attribute fields. TensorRT's ONNX parser hands a node's attributes to a plugin creator typed by the ONNX
attribute type, whatever the creator declares (onnx-tensorrt `loadFields` / `copyField`): INT -> one INT32,
FLOAT -> one FLOAT32, STRING -> CHAR bytes *with* the terminating NUL. `tensorrt.plugin` then converts each
field to the annotation of the `register` function: for `int` / `float` it calls `int(data)` / `float(data)` on
the 1-element array in TensorRT 10.x-11.1, which NumPy >= 2 rejects (11.2+ index the element first), and for
`str` it decodes every byte, NUL included. So numeric attributes are declared as 1-element NumPy arrays
(`Int32Field`, `Float32Field`; every QDP version converts those with `astype`) and read with `scalar`, and
strings are read with `text`. TensorRT 10.9+ (AOT plugins) with any NumPy is the supported range.

Buffers. `Tensor.__cuda_array_interface__` refuses BF16, so `as_torch` builds the interface itself (BF16
through an int16 view) and every plugin wraps its buffers with it.

Tactic runs. TensorRT may execute a plugin while timing tactics with unspecified input contents; the Triton
kernels clamp their index inputs themselves, host-side code (DSAIndexer) calls `clamp_ragged_indices` first.

AOT kernels (`aot_kernel_code`): the launch contract of `aot_contract.py`, with the dynamic shared memory the kernel needs
declared in its launch parameters; a kernel needing more than the 48 KiB a launch gets without an opt-in is
refused with a clear message (contract AOT_SHARED_MEMORY_OPT_IN_UNKNOWN): such plugins run their JIT
implementation (recipe tensorrt.prefer_aot: false).
"""

import numpy as np
import numpy.typing as npt
import tensorrt as trt
import torch

from .aot_contract import tensorrt_ptx

Int32Field = npt.NDArray[np.int32]
Float32Field = npt.NDArray[np.float32]

# TensorRT data type -> (array-interface type string, itemsize); BF16 travels as int16 and is viewed back.
_TYPESTR = {
    trt.float32: ("<f4", 4),
    trt.float16: ("<f2", 2),
    trt.bfloat16: ("<i2", 2),
    trt.int64: ("<i8", 8),
    trt.int32: ("<i4", 4),
    trt.int8: ("|i1", 1),
    trt.uint8: ("|u1", 1),
    trt.bool: ("|b1", 1),
}


def aot_kernel_code(kernel, plugin_id: str, num_params: int) -> str:
    """The code an `aot_impl` hands TensorRT for a compiled Triton kernel: `aot_contract.tensorrt_ptx` (the PTX
    whose entry takes exactly TensorRT's `num_params` parameters); ValueError when the kernel needs more dynamic
    shared memory than a launch gets without opting in. TensorRT takes the launch's dynamic shared memory from
    `KernelLaunchParams.shared_mem` (tensorrt_bindings/plugin/_plugin_class.py (11.4.0.106) line 426); nothing
    public shows its AOT launcher opting a kernel into more than 48 KiB (contract
    AOT_SHARED_MEMORY_OPT_IN_UNKNOWN), so such a kernel is refused with the way out."""
    from moe_export.plugins.tensorrt_contracts import DEFAULT_DYNAMIC_SHARED_MEMORY

    shared = int(kernel.metadata.shared)
    if shared > DEFAULT_DYNAMIC_SHARED_MEMORY:
        raise ValueError(
            f"{plugin_id}: the AOT kernel needs {shared} B of dynamic shared memory, above the "
            f"{DEFAULT_DYNAMIC_SHARED_MEMORY} B a launch gets without an opt-in, and TensorRT's AOT launcher is not "
            "known to opt in (contract AOT_SHARED_MEMORY_OPT_IN_UNKNOWN): build with recipe tensorrt.prefer_aot: false "
            "(the JIT launch opts in)"
        )
    return tensorrt_ptx(kernel, plugin_id, num_params)


def scalar(field: np.ndarray) -> int | float:
    """The Python number in a 1-element numeric attribute field."""
    return field.reshape(-1)[0].item()


def text(field: str) -> str:
    """A string attribute without the NUL terminator the ONNX parser appends."""
    return field.rstrip("\x00")


def cuda_array_interface(tensor) -> dict:
    """`__cuda_array_interface__` (v3) of a QDP `Tensor` for any of our dtypes; strides in bytes."""
    typestr, itemsize = _TYPESTR[tensor.dtype]
    return {
        "shape": tuple(int(d) for d in tensor.shape),
        "typestr": typestr,
        "data": (int(tensor.data_ptr), False),
        "strides": tuple(int(s) * itemsize for s in tensor.strides),
        "version": 3,
        "stream": None,  # the impl already runs on TensorRT's stream
    }


class _DeviceBuffer:
    def __init__(self, tensor):
        self.__cuda_array_interface__ = cuda_array_interface(tensor)


def as_torch(tensor) -> torch.Tensor:
    """A torch CUDA view (no copy) of a QDP `Tensor`'s buffer, BF16 included."""
    view = torch.as_tensor(_DeviceBuffer(tensor), device="cuda")
    return view.view(torch.bfloat16) if tensor.dtype == trt.bfloat16 else view


def clamp_ragged_indices(
    cu_seqlens: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens [N+1] into [0, T] and non-decreasing, block_tables [N, B] to at least -1 (-1 = unused; the
    kernels clamp block ids to their pool's capacity, which only the pool table on the device holds), positions
    [T] into [0, B*BS-1] (T = positions rows): identity on valid inputs, in bounds on the garbage of tactic runs."""
    num_tokens = positions.shape[0]
    cu = torch.cummax(cu_seqlens.clamp(0, num_tokens), 0).values
    return cu, block_tables.clamp(min=-1), positions.clamp(0, max(block_tables.shape[1] * block_size - 1, 0))

"""TensorRT quickly-deployable plugin (QDP) for ShortConv, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields, output types / shapes / aliasing, and the `aot_impl` launch parameters with the real Triton
compile (cubin and PTX for sm_90). The kernel itself is tested in the interpreter.

Importing this module registers ``moe_export::ShortConv`` (name = op type, namespace = the node's
``plugin_namespace`` attribute, version "1"). ``conv_pool_out`` is declared *aliased* to ``conv_pool`` (in
place, only the N addressed slots are written; needs ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``, which the
builder enables). ``impl`` (JIT) launches the kernel on TensorRT's stream; ``aot_impl`` compiles the same
kernel for the target GPU (its cubin, PTX as fallback): parameters are the 5 input pointers, the int32 extras T (tokens) and S (pool slots), then the 2
output pointers; grid (cdiv(C, BC), N). Open risk, checked by ``benchmarks/gpu_check.sh`` on a GPU: Triton
>= 3.3 appends scratch-pointer parameters that TensorRT does not pass.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import aot_kernel_code, as_torch
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .triton_kernel import aot_compile, block_sizes, launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_TRITON_TYPE = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}


@trtp.register(PLUGIN_ID)
def _describe(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    conv_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """y like x [T, C]; conv_pool_out aliases conv_pool [S, C, W-1]."""
    return x.like(), conv_pool.aliased()


@trtp.autotune(PLUGIN_ID)
def _formats(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    conv_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """x/y and the pool each fp32, fp16 or bf16 (pool dtype = x dtype or fp32); weight fp32; linear."""
    combos = []
    for a in ("FP32", "FP16", "BF16"):
        for p in sorted({a, "FP32"}):
            combos.append(trtp.AutoTuneCombination(f"{a}, FP32, {p}, INT64, INT64, {a}, {p}"))
    return combos


@trtp.impl(PLUGIN_ID)
def _run(
    x: trtp.Tensor,
    weight: trtp.Tensor,
    conv_pool: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    outputs: tuple[trtp.Tensor, trtp.Tensor],
    stream: int,
) -> None:
    """Launch the Triton kernel on TensorRT's stream; the pool is updated in place (aliased output)."""
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tx, tw, pool, cu, slots = (as_torch(t) for t in (x, weight, conv_pool, cu_seqlens, slot_ids))
        y, pool_out = as_torch(outputs[0]), as_torch(outputs[1])
        launch(tx, tw, pool, cu, slots, y, pool_out)


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    conv_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's cubin for the target GPU (PTX as fallback); C and W must be build-time constants (weight is an initializer)."""
    C = weight.shape_expr[0].constant_value()
    W = weight.shape_expr[1].constant_value()
    kernel = aot_compile(_TRITON_TYPE[x.dtype], _TRITON_TYPE[conv_pool.dtype], C, W, target_capability())
    params = trtp.KernelLaunchParams()
    params.grid_x = -(-C // block_sizes(C, W)[1])
    params.grid_y = slot_ids.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(x.shape_expr[0]), trtp.SymInt32(conv_pool.shape_expr[0])])
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID), params, extra_args

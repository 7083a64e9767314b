"""TensorRT quickly-deployable plugin (QDP) for ShortConv, backed by the Triton kernel.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (the PyPI wheels fetch the real
libraries from NVIDIA's index, unreachable here; the lent GPU image has no TensorRT either), so this module
has never been imported or run. It follows the QDP API as read from TensorRT's public ``tensorrt.plugin``
sources and samples. What is tested elsewhere: the Triton kernel (interpreter, vs the reference, including
the in-place pool path used here) and that ``triton_kernel.aot_compile`` produces sm_90 PTX.

Importing this module registers ``moe_export::ShortConv`` (namespace = ONNX domain, name = op type, version
"1"); TensorRT's ONNX parser (>= 10.10) binds it to the bare ONNX node. Nothing else in the package imports
it. ``conv_pool_out`` is declared *aliased* to ``conv_pool`` (in place; only the N addressed slots are
written). ``impl`` (JIT) launches the kernel on TensorRT's stream; ``aot_impl`` compiles the same kernel to
PTX: parameters are the 5 input pointers then the 2 output pointers, no extra scalars, grid (cdiv(C, BC), N).
Open risk: Triton >= 3.3 appends two scratch-pointer parameters (unused here) that TensorRT does not pass.
"""

from __future__ import annotations

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
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
        tx, tw, pool, cu, slots = (
            torch.as_tensor(t, device="cuda") for t in (x, weight, conv_pool, cu_seqlens, slot_ids)
        )
        y = torch.as_tensor(outputs[0], device="cuda")
        pool_out = torch.as_tensor(outputs[1], device="cuda")
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
    """PTX of the kernel for the build GPU; C and W must be build-time constants (weight is an initializer)."""
    C = weight.shape_expr[0].constant_value
    W = weight.shape_expr[1].constant_value
    major, minor = torch.cuda.get_device_capability()
    kernel = aot_compile(_TRITON_TYPE[x.dtype], _TRITON_TYPE[conv_pool.dtype], C, W, major * 10 + minor)
    params = trtp.KernelLaunchParams()
    params.grid_x = -(-C // block_sizes(C, W)[1])
    params.grid_y = slot_ids.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    return kernel.metadata.name, kernel.asm["ptx"], params, trtp.SymIntExprs(0)

"""TensorRT quickly-deployable plugin (QDP) for GatedDeltaScan, backed by the Triton kernel.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (the PyPI wheels fetch the real
libraries from NVIDIA's index, unreachable here; the lent GPU image has no TensorRT either), so this module
has never been imported or run. It follows the QDP API as read from TensorRT's public ``tensorrt.plugin``
sources and samples. What is tested elsewhere: the Triton kernel (interpreter, vs the reference, including
the V-first in-place pool path used here) and that ``triton_kernel.aot_compile`` produces sm_90 PTX.

Importing this module registers ``moe_export::GatedDeltaScan`` (namespace = ONNX domain, name = op type,
version "1"); TensorRT's ONNX parser (>= 10.10) binds it to the bare ONNX node and passes the node
attributes ``scale`` and ``use_qk_l2norm`` as plugin fields. Nothing else in the package imports it.

- ``state_pool_out`` is declared *aliased* to ``state_pool`` (in place): the kernel reads each state tile
  before writing it, and only the N addressed slots are touched.
- ``impl`` (JIT, needs Python in the engine) launches the kernel on TensorRT's stream.
- ``aot_impl`` compiles the same kernel to PTX for the build GPU. Kernel parameters are the 8 input
  pointers then the 2 output pointers, no extra scalars; grid (cdiv(V, BV), H, N). Open risk: Triton >= 3.3
  appends two scratch-pointer parameters (unused by this kernel: scratch sizes 0) that TensorRT does not pass.
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
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    state_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    scale: float,
    use_qk_l2norm: int,
) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """o like v [T, H, V]; state_pool_out aliases state_pool [S, H, V, K] fp32."""
    return v.like(), state_pool.aliased()


@trtp.autotune(PLUGIN_ID)
def _formats(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    state_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """q, k, v, o share one of fp32/fp16/bf16; g, beta and the pool are fp32; index inputs int64; linear."""
    return [
        trtp.AutoTuneCombination(f"{a}, {a}, {a}, FP32, FP32, FP32, INT64, INT64, {a}, FP32")
        for a in ("FP32", "FP16", "BF16")
    ]


@trtp.impl(PLUGIN_ID)
def _run(
    q: trtp.Tensor,
    k: trtp.Tensor,
    v: trtp.Tensor,
    g: trtp.Tensor,
    beta: trtp.Tensor,
    state_pool: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    scale: float,
    use_qk_l2norm: int,
    outputs: tuple[trtp.Tensor, trtp.Tensor],
    stream: int,
) -> None:
    """Launch the Triton kernel on TensorRT's stream; the pool is updated in place (aliased output)."""
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tq, tk, tv, tg, tb, pool, cu, slots = (
            torch.as_tensor(x, device="cuda") for x in (q, k, v, g, beta, state_pool, cu_seqlens, slot_ids)
        )
        o = torch.as_tensor(outputs[0], device="cuda")
        pool_out = torch.as_tensor(outputs[1], device="cuda")
        launch(tq, tk, tv, tg, tb, pool, cu, slots, o, pool_out, scale, bool(use_qk_l2norm), True)


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    state_pool: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    scale: float,
    use_qk_l2norm: int,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """PTX of the kernel for the build GPU; H, K, V must be build-time constants (they are for K3: 96/128/128)."""
    H = q.shape_expr[1].constant_value
    K = q.shape_expr[2].constant_value
    V = v.shape_expr[2].constant_value
    major, minor = torch.cuda.get_device_capability()
    kernel = aot_compile(_TRITON_TYPE[q.dtype], H, K, V, scale, bool(use_qk_l2norm), True, major * 10 + minor)
    params = trtp.KernelLaunchParams()
    params.grid_x = -(-V // block_sizes(K, V)[1])
    params.grid_y = H
    params.grid_z = slot_ids.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    return kernel.metadata.name, kernel.asm["ptx"], params, trtp.SymIntExprs(0)

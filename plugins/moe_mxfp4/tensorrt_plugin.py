"""TensorRT quickly-deployable plugin (QDP) for MoEMXFP4, backed by the Triton W4A16 grouped-GEMM kernels.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (the PyPI wheels fetch the real
libraries from NVIDIA's index, unreachable here; the lent GPU image has no TensorRT either), so this file has
never been imported or run. It follows the QDP API as read from TensorRT's public `tensorrt.plugin` sources.
Hopper has no FP4 math, so the weights stay packed in memory and are dequantized inside the kernel.

Importing this module registers `moe_export::MoEMXFP4` (namespace = ONNX domain, name = op type, version
"1"), which TensorRT's ONNX parser (>= 10.10) binds to the bare ONNX node. Nothing else in the package imports
it. Only a JIT `impl` (Python callback) is provided, so engines need Python at runtime.

Why there is no `aot_impl`: a QDP AOT implementation is one kernel launch whose only tensors are the plugin's
inputs and outputs, but `triton_kernel.moe_mxfp4_triton` is host-side torch work plus two launches:
`padded_expert_blocks` sorts the (token, choice) pairs routed to this rank by local expert and pads each
expert's run to a multiple of BLOCK_M (argsort, unique_consecutive, and a data-dependent number of M-blocks read
back to size the grid); the up kernel writes an intermediate activation buffer [P_pad, I]; the down kernel
writes a [T*k, D] buffer that torch zero-fills beforehand and sums over the k choices afterwards. An AOT
version needs a fused single-launch MoE kernel: expert grouping done in the kernel (each program finds the
pairs of its expert from `expert_ids`, e.g. by a per-expert scan or a persistent grid over experts, so the grid
depends only on shapes), the up-projection activation kept on chip between the two GEMMs, and the k routed
contributions of a token reduced without a host-side buffer and sum (deterministically, not by float atomics).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from .onnx_schema import OP_TYPE
from .triton_kernel import moe_mxfp4_triton

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    x: trtp.TensorDesc,
    expert_ids: trtp.TensorDesc,
    expert_weights: trtp.TensorDesc,
    w13_packed: trtp.TensorDesc,
    w13_scale: trtp.TensorDesc,
    w2_packed: trtp.TensorDesc,
    w2_scale: trtp.TensorDesc,
    expert_offset: int,
    activation: str,
    situ_beta: float,
    situ_linear_beta: float,
) -> trtp.TensorDesc:
    """y [T, D] fp32, the shape of x."""
    return trtp.from_shape_expr((x.shape_expr[0], x.shape_expr[1]), dtype=trt.float32)


@trtp.autotune(PLUGIN_ID)
def _formats(
    x: trtp.TensorDesc,
    expert_ids: trtp.TensorDesc,
    expert_weights: trtp.TensorDesc,
    w13_packed: trtp.TensorDesc,
    w13_scale: trtp.TensorDesc,
    w2_packed: trtp.TensorDesc,
    w2_scale: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 activations, int64 ids, fp32 routing weights, uint8 MXFP4 bytes, fp32 output; linear layout."""
    return [trtp.AutoTuneCombination("FP32, INT64, FP32, UINT8, UINT8, UINT8, UINT8, FP32")]


@trtp.impl(PLUGIN_ID)
def _run(
    x: trtp.Tensor,
    expert_ids: trtp.Tensor,
    expert_weights: trtp.Tensor,
    w13_packed: trtp.Tensor,
    w13_scale: trtp.Tensor,
    w2_packed: trtp.Tensor,
    w2_scale: trtp.Tensor,
    expert_offset: int,
    activation: str,
    situ_beta: float,
    situ_linear_beta: float,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run the Triton kernels on TensorRT's stream and copy into the output buffer."""
    args = [
        torch.as_tensor(t, device="cuda")
        for t in (x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    ]
    out = torch.as_tensor(outputs[0], device="cuda")
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        y = moe_mxfp4_triton(
            *args,
            expert_offset=expert_offset,
            activation=activation,
            situ_beta=situ_beta,
            situ_linear_beta=situ_linear_beta,
        )
        out.copy_(y)

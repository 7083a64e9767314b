"""TensorRT quickly-deployable plugin (QDP) for MoEMXFP4, backed by the Triton W4A16 grouped-GEMM kernels.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields (`expert_offset` one INT32, `activation` CHAR with the parser's NUL, the betas one FLOAT32
each), output type and shape. Hopper has no FP4 math, so the weights stay packed in memory and are
dequantized inside the kernel.

Importing this module registers `moe_export::MoEMXFP4` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"). Only a JIT `impl` (Python callback) is provided, so engines need
Python at runtime. Expert ids outside this rank's range are ignored by design, so the garbage inputs of
TensorRT's tactic runs stay in bounds.

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
from ..tensorrt_common import Float32Field, Int32Field, as_torch, scalar, text
from .onnx_schema import OP_TYPE
from .reference import ACTIVATIONS
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
    expert_offset: Int32Field,
    activation: str,
    situ_beta: Float32Field,
    situ_linear_beta: Float32Field,
) -> trtp.TensorDesc:
    """y [T, D] fp32, the shape of x; an unknown activation fails the build here, not at run time."""
    if text(activation) not in ACTIVATIONS:
        raise ValueError(f"{PLUGIN_ID}: activation must be one of {ACTIVATIONS}, got {text(activation)!r}")
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
    expert_offset: Int32Field,
    activation: str,
    situ_beta: Float32Field,
    situ_linear_beta: Float32Field,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run the Triton kernels on TensorRT's stream and copy into the output buffer."""
    args = [as_torch(t) for t in (x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale)]
    out = as_torch(outputs[0])
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        y = moe_mxfp4_triton(
            *args,
            expert_offset=scalar(expert_offset),
            activation=text(activation),
            situ_beta=scalar(situ_beta),
            situ_linear_beta=scalar(situ_linear_beta),
        )
        out.copy_(y)

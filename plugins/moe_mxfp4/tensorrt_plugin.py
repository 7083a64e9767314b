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

The packed MXFP4 bytes are in the Triton kernel's layout (`layout.py`), written so by the convert stage of
TensorRT builds (engines built before that layout need a rebuild).
MXFP4 bytes arrive as INT8: TensorRT graphs declare the experts' uint8 bytes as int8 views of the same bytes,
because the ONNX parser widens uint8 initializers to int32 (`plugins/tensorrt_contracts.py`:
PARSER_UINT8_WEIGHTS_BECOME_INT32, ADD_CONSTANT_NO_UINT8); the impl views them back as uint8 (no copy). The
engine holds them at 4.25 bits per weight, as the planner counts.

Rows on the device: the eighth input `row_counts` (int64) says, summed, how many leading rows of x carry tokens.
After a MoEDispatch (dp layout) it is the dispatch's recv_counts, so the op computes the rows received and never
the rest of the static receive buffer; in the all-reduce layout the graph feeds one constant count of at least the
step's tokens and the op takes every row, on its static grids. bf16 in and out (the only format the kernels
take): no Casts around the op.

No host synchronization in `impl` (the pair layout is one kernel sized from shapes, `triton_kernel.pair_layout`)
and bounded scratch (tokens in chunks), so the launches can be captured in a CUDA graph. The result is written
straight into TensorRT's output buffer. QDP plugins get no TensorRT workspace (contract QDP_NO_WORKSPACE), so the
chunk's partial sums, activations and pair layout live in a second, declared output `scratch` [scratch_bytes]
int8 (`sizes.workspace_bytes` at the recipe's max_num_tokens, set by the graph exporter): TensorRT places it in
the engine's device memory like any activation, reused between layers.

Why there is no `aot_impl`: a QDP AOT implementation is one kernel launch whose only tensors are the plugin's
inputs and outputs, but `triton_kernel.moe_mxfp4_triton` is four launches (pair layout, up, down, combine; five with a split up) with
intermediate buffers. An AOT version needs a fused single-launch MoE kernel
(expert grouping in the kernel, the up-projection activation kept on chip, the k routed contributions reduced
in the kernel, deterministically).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..collectives.nccl import received_rows_bound
from ..tensorrt_common import Float32Field, Int32Field, as_torch, scalar, text
from .onnx_schema import OP_TYPE
from .inputs import ACTIVATIONS
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
    row_counts: trtp.TensorDesc,
    expert_offset: Int32Field,
    activation: str,
    situ_beta: Float32Field,
    situ_linear_beta: Float32Field,
    scratch_bytes: Int32Field,
) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """y [T, D] like x (bf16), and the workspace [scratch_bytes] int8; an unknown activation fails the
    build here, not at run time."""
    if text(activation) not in ACTIVATIONS:
        raise ValueError(f"{PLUGIN_ID}: activation must be one of {ACTIVATIONS}, got {text(activation)!r}")
    return (trtp.from_shape_expr((x.shape_expr[0], x.shape_expr[1]), dtype=x.dtype),
            trtp.from_shape_expr((scalar(scratch_bytes),), dtype=trt.int8))  # fmt: skip


@trtp.autotune(PLUGIN_ID)
def _formats(
    x: trtp.TensorDesc,
    expert_ids: trtp.TensorDesc,
    expert_weights: trtp.TensorDesc,
    w13_packed: trtp.TensorDesc,
    w13_scale: trtp.TensorDesc,
    w2_packed: trtp.TensorDesc,
    w2_scale: trtp.TensorDesc,
    row_counts: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """Activations in and out in bf16, int64 ids, fp32 routing weights, MXFP4 bytes as INT8 (views of the uint8
    bytes), int64 row counts, INT8 workspace; linear layout."""
    return [trtp.AutoTuneCombination("BF16, INT64, FP32, INT8, INT8, INT8, INT8, INT64, BF16, INT8")]


@trtp.impl(PLUGIN_ID)
def _run(
    x: trtp.Tensor,
    expert_ids: trtp.Tensor,
    expert_weights: trtp.Tensor,
    w13_packed: trtp.Tensor,
    w13_scale: trtp.Tensor,
    w2_packed: trtp.Tensor,
    w2_scale: trtp.Tensor,
    row_counts: trtp.Tensor,
    expert_offset: Int32Field,
    activation: str,
    situ_beta: Float32Field,
    situ_linear_beta: Float32Field,
    scratch_bytes: Int32Field,
    outputs: tuple[trtp.Tensor, trtp.Tensor],
    stream: int,
) -> None:
    """Run the Triton kernels on TensorRT's stream, writing into the output buffer, with the partial sums and
    activations in the workspace output (no host synchronization). The rows computed are the first
    sum(row_counts) of x, a device value, after a MoEDispatch (the rows received, over chunks bounded on the host
    by the pending dispatch's `received_rows_bound`, on device-bounded grids); else all of x's rows on static
    grids. bf16 x on the tensor cores (bf16 operands, fp32 accumulation)."""
    x_t, ids, w = (as_torch(t) for t in (x, expert_ids, expert_weights))
    weights = [as_torch(t).view(torch.uint8) for t in (w13_packed, w13_scale, w2_packed, w2_scale)]
    bound = received_rows_bound()  # None outside a dispatch (all-reduce layout): every row, static grids
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        moe_mxfp4_triton(
            x_t, ids, w, *weights,
            recv_counts=None if bound is None else as_torch(row_counts),
            row_bound=None if bound is None else min(bound, x_t.shape[0]),
            expert_offset=scalar(expert_offset),
            activation=text(activation),
            situ_beta=scalar(situ_beta),
            situ_linear_beta=scalar(situ_linear_beta),
            out=as_torch(outputs[0]),
            workspace=as_torch(outputs[1]).view(torch.uint8),
        )  # fmt: skip

"""TensorRT quickly-deployable plugin (QDP) for DSAIndexer: the Triton score kernel plus torch top-k selection.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields (`topk` arrives as one INT32), output type and shape.

Importing this module registers `moe_export::DSAIndexer` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"). Only a JIT `impl` (Python callback) is provided, so engines need
Python at runtime. TensorRT may run the impl while timing tactics with garbage inputs: the index inputs are
clamped first (`clamp_ragged_indices`), which also bounds the score buffer sized from `positions.max()`.

Why there is no `aot_impl`: a QDP AOT implementation is one kernel launch whose only tensors are the plugin's
inputs and outputs, but `triton_kernel.dsa_indexer_triton` is not one launch. It (1) reads `positions.max()`
back to the host to size an intermediate score buffer [T, max(positions)+1], (2) launches the score kernel
into that buffer, and (3) selects the top-k in torch (`cpu.select_topk`: a stable descending sort of every
score row, ties to the lower position, -inf -> -1 padding). The Triton kernel alone writes scores, not the
[T, topk] indices the op outputs. An AOT version needs a device top-k kernel: one program per token that
computes its scores over cache positions 0..pos itself and keeps the `topk` best (topk = 2048 for DeepSeek-V3.2)
with the same tie rule, e.g. a radix / threshold select over the row held in shared memory or recomputed per
pass, writing the indices directly, so that scores never need a buffer outside the kernel.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import Int32Field, as_torch, clamp_ragged_indices, scalar
from .onnx_schema import OP_TYPE
from .triton_kernel import dsa_indexer_triton

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    k_pool: trtp.TensorDesc,
    k_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk: Int32Field,
) -> trtp.TensorDesc:
    """indices [T, topk] int64 from q_idx [T, Hi, Di]."""
    return trtp.from_shape_expr((q_idx.shape_expr[0], scalar(topk)), dtype=trt.int64)


@trtp.autotune(PLUGIN_ID)
def _formats(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    k_pool: trtp.TensorDesc,
    k_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 queries, weights and new keys, fp32, bf16 or uint8 (fp8 rows + scale byte) key pool; int64
    bookkeeping inputs and output."""
    return [trtp.AutoTuneCombination(f"FP32, FP32, {pool}, FP32, INT64, INT64, INT64, INT64")
            for pool in ("FP32", "BF16", "UINT8")]


@trtp.impl(PLUGIN_ID)
def _run(
    q_idx: trtp.Tensor,
    weights: trtp.Tensor,
    k_pool: trtp.Tensor,
    k_new: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    block_tables: trtp.Tensor,
    positions: trtp.Tensor,
    topk: Int32Field,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run on TensorRT's stream (index inputs clamped into their buffers) and copy into the output buffer."""
    q, w, pool, new, cu, tables, pos = (
        as_torch(t) for t in (q_idx, weights, k_pool, k_new, cu_seqlens, block_tables, positions)
    )
    out = as_torch(outputs[0])
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        cu, tables, pos = clamp_ragged_indices(cu, tables, pos, pool.shape[0], pool.shape[1])
        out.copy_(dsa_indexer_triton(q, w, pool, new, cu, tables, pos, topk=scalar(topk)))

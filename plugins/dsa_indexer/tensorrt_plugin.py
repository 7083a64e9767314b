"""TensorRT quickly-deployable plugin (QDP) for DSAIndexer: the Triton score and top-k select kernels.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields (`topk` arrives as one INT32), output type and shape.

Importing this module registers `moe_export::DSAIndexer` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"). Only a JIT `impl` (Python callback) is provided, so engines need
Python at runtime. TensorRT may run the impl while timing tactics with garbage inputs: the index inputs are
clamped first (`clamp_ragged_indices`, on the device) and the kernel reads no pool memory through a garbage pool
table row. The key pool is no tensor of the network: input 2 is the pool table
(`plugins/pool_table.py`), fields `pool` (its row), `block_size` and `pool_dtype` describe the pool.

No host synchronization and bounded scratch: candidates span the block table's capacity (from shapes), and
scores are made and selected in chunks of tokens x positions (`triton_kernel.chunked_topk`, near 256 MiB whatever
the context length); the indices are written straight into TensorRT's output buffer, and every chunk buffer lives
in the plugin's second output `scratch` [scratch_bytes] int8 (`sizes.workspace_bytes` at the recipe's
limits, set by the graph exporter), so TensorRT places it in the engine's device memory (QDP plugins get no
workspace: contract QDP_NO_WORKSPACE).

Why there is no `aot_impl`: a QDP AOT implementation is one kernel launch whose only tensors are the plugin's
inputs and outputs; the chunked score kernel plus the select kernel (a radix select per chunk) is several
launches per chunk.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..pool_table import CACHE_DTYPES
from ..tensorrt_common import Int32Field, as_torch, clamp_ragged_indices, scalar, text
from .onnx_schema import OP_TYPE
from .triton_kernel import dsa_indexer_launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    k_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk: Int32Field,
    scratch_bytes: Int32Field,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """indices [T, topk] int64 from q_idx [T, Hi, Di], and the workspace [scratch_bytes] int8."""
    return (trtp.from_shape_expr((q_idx.shape_expr[0], scalar(topk)), dtype=trt.int64),
            trtp.from_shape_expr((scalar(scratch_bytes),), dtype=trt.int8))  # fmt: skip


@trtp.autotune(PLUGIN_ID)
def _formats(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    k_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc, trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 queries, weights and new keys; the int64 pool table (the key pool's dtype is the `pool_dtype` field),
    int64 bookkeeping inputs and output; int8 workspace."""
    return [trtp.AutoTuneCombination("FP32, FP32, INT64, FP32, INT64, INT64, INT64, INT64, INT8")]


@trtp.impl(PLUGIN_ID)
def _run(
    q_idx: trtp.Tensor,
    weights: trtp.Tensor,
    pool_table: trtp.Tensor,
    k_new: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    block_tables: trtp.Tensor,
    positions: trtp.Tensor,
    topk: Int32Field,
    scratch_bytes: Int32Field,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
    outputs: tuple[trtp.Tensor, trtp.Tensor],
    stream: int,
) -> None:
    """Run on TensorRT's stream (index inputs clamped on the device; the key pool read through the pool table),
    writing into the output buffer."""
    q, w, table, new, cu, tables, pos = (
        as_torch(t) for t in (q_idx, weights, pool_table, k_new, cu_seqlens, block_tables, positions)
    )
    out = as_torch(outputs[0])
    bs = scalar(block_size)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        cu, tables, pos = clamp_ragged_indices(cu, tables, pos, bs)
        dsa_indexer_launch(q, w, table, scalar(pool), bs, CACHE_DTYPES[text(pool_dtype)], new, cu, tables, pos,
                           topk=scalar(topk), out=out, workspace=as_torch(outputs[1]).view(torch.uint8))

"""TensorRT quickly-deployable plugin (QDP) for DSAIndexer: the Triton score kernel plus torch top-k selection.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (the PyPI wheels fetch the real
libraries from NVIDIA's index, unreachable here; the lent GPU image has no TensorRT either), so this file has
never been imported or run. It follows the QDP API as read from TensorRT's public `tensorrt.plugin` sources.

Importing this module registers `moe_export::DSAIndexer` (namespace = ONNX domain, name = op type, version
"1"), which TensorRT's ONNX parser (>= 10.10) binds to the bare ONNX node. Nothing else in the package imports
it. Only a JIT `impl` (Python callback) is provided, no AOT kernel, so engines need Python at runtime.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from .onnx_schema import OP_TYPE
from .triton_kernel import dsa_indexer_triton

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    k_cache: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk: int,
) -> trtp.TensorDesc:
    """indices [T, topk] int64 from q_idx [T, Hi, Di]."""
    return trtp.from_shape_expr((q_idx.shape_expr[0], topk), dtype=trt.int64)


@trtp.autotune(PLUGIN_ID)
def _formats(
    q_idx: trtp.TensorDesc,
    weights: trtp.TensorDesc,
    k_cache: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 queries, weights and keys; int64 bookkeeping inputs and output; linear layout."""
    return [trtp.AutoTuneCombination("FP32, FP32, FP32, INT64, INT64, INT64, INT64")]


@trtp.impl(PLUGIN_ID)
def _run(
    q_idx: trtp.Tensor,
    weights: trtp.Tensor,
    k_cache: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    positions: trtp.Tensor,
    topk: int,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run on TensorRT's stream and copy into the output buffer."""
    args = [torch.as_tensor(t, device="cuda") for t in (q_idx, weights, k_cache, cu_seqlens, slot_ids, positions)]
    out = torch.as_tensor(outputs[0], device="cuda")
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        out.copy_(dsa_indexer_triton(*args, topk=topk))

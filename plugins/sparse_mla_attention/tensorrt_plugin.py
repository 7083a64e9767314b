"""TensorRT quickly-deployable plugin (QDP) for SparseMLAAttention, backed by the Triton kernel.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (the PyPI wheels fetch the real
libraries from NVIDIA's index, unreachable here; the lent GPU image has no TensorRT either), so this file has
never been imported or run. It follows the QDP API as read from TensorRT's public `tensorrt.plugin` sources.

Importing this module registers `moe_export::SparseMLAAttention` (namespace = ONNX domain, name = op type,
version "1"), which TensorRT's ONNX parser (>= 10.10) binds to the bare ONNX node. Nothing else in the package
imports it. Only a JIT `impl` (Python callback) is provided, no AOT kernel, so engines need Python at runtime.

QDP input lists are fixed, so the plugin always has six inputs: the TensorRT graph gives dense-causal layers an
empty [T, 0] (or [0, 0]) int64 `topk_indices`, which the op defines as dense (see `reference.py`).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from .onnx_schema import OP_TYPE
from .triton_kernel import sparse_mla_attention_triton

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    q_lat: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk_indices: trtp.TensorDesc,
    scale: float,
    kv_lora_rank: int,
) -> trtp.TensorDesc:
    """o_lat [T, H, kv_lora_rank] fp32 from q_lat [T, H, Dc+Dr]."""
    return trtp.from_shape_expr((q_lat.shape_expr[0], q_lat.shape_expr[1], kv_lora_rank), dtype=trt.float32)


@trtp.autotune(PLUGIN_ID)
def _formats(
    q_lat: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk_indices: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 activations and cache, int64 index inputs, linear layout."""
    return [trtp.AutoTuneCombination("FP32, FP32, INT64, INT64, INT64, INT64, FP32")]


@trtp.impl(PLUGIN_ID)
def _run(
    q_lat: trtp.Tensor,
    kv_cache: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    positions: trtp.Tensor,
    topk_indices: trtp.Tensor,
    scale: float,
    kv_lora_rank: int,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run the Triton kernel on TensorRT's stream and copy into the output buffer."""
    as_torch = [torch.as_tensor(t, device="cuda") for t in (q_lat, kv_cache, cu_seqlens, slot_ids, positions)]
    indices = torch.as_tensor(topk_indices, device="cuda")
    out = torch.as_tensor(outputs[0], device="cuda")
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        result = sparse_mla_attention_triton(*as_torch, indices, scale=scale, kv_lora_rank=kv_lora_rank)
        out.copy_(result)

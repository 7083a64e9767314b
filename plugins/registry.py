"""Which plugin folder implements each custom op type, and the per-op hooks the backends need."""

from __future__ import annotations

import importlib

import onnx

OP_FOLDERS = {
    "GatedDeltaScan": "gated_delta_scan",
    "ShortConv": "short_conv",
    "SparseMLAAttention": "sparse_mla_attention",
    "DSAIndexer": "dsa_indexer",
    "PagedCacheWrite": "paged_cache_write",
    "MoEMXFP4": "moe_mxfp4",
    "AllReduce": "collectives",
    "AllGather": "collectives",
    "MoEDispatch": "collectives",
    "MoECombine": "collectives",
}


def _module(op_type: str, part: str):
    return importlib.import_module(f"moe_export.plugins.{OP_FOLDERS[op_type]}.{part}")


def register_all_schemas() -> None:
    """Register every custom op's ONNX schema so onnx.checker and shape inference accept our graphs."""
    for op_type in OP_FOLDERS:
        _module(op_type, "onnx_schema").register()


CACHE_OPS = ("SparseMLAAttention", "DSAIndexer")  # ops reading a paged cache pool


def ort_function(op_type: str, fp8_cache: bool = False) -> onnx.FunctionProto:
    """The ONNX Runtime body (a model-local function in standard ops) for `op_type`; `fp8_cache`: the cache ops'
    body for uint8 fp8 pools (`moe_export.quantize.fp8_cache`)."""
    if op_type in CACHE_OPS:
        return _module(op_type, "ort").function_proto(fp8_pool=fp8_cache)
    return _module(op_type, "ort").function_proto()

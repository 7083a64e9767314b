"""What a backend asks of a rank graph (`GraphForm`) and the cache pools' storage: element types and, for graphs
whose pools stay in place, the pool table input and metadata key.

Compute dtype. CPU builds (backend onnxruntime) compute in fp32. GPU builds (backend tensorrt) compute in
bf16: bf16 weights are used as stored (TensorRT folds a Cast of an initializer into a converted copy, so an
fp32 graph would hold every weight in fp32), activations, GEMMs and collectives are bf16, and fp32 stays where
the model needs it: router scores (from the bf16 GEMM's logits) and top-k, KDA gates (A_log, dt_bias, decay,
beta) and recurrent state, conv taps, RMS / layer norm and attention-residual arithmetic, the plugins' fp32
inputs, caches and logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_export.common.errors import InputError
from onnx import TensorProto

# recipe kv_cache -> pool element type; fp8 pools are uint8 rows of E4M3 codes + one E8M0 scale byte
# (`moe_export.quantize.fp8_cache`), so their last dim is D + 1
CACHE_STORAGE = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "fp8": TensorProto.UINT8}
POOLS_KEY = "pools"  # TensorRT graphs' metadata: the pools in pool-table row order (name, element type, dims)
POOL_TABLE = "pool_table"  # TensorRT graphs' input [P, 3] int64 (plugins/pool_table.py)


@dataclass(frozen=True)
class GraphForm:
    """What a backend asks of a rank graph. compute_dtype: ONNX element type of activations (and of weights used
    as stored); pools_in_place: no state pool is a graph input or output, the plugins reach the pools through the
    pool table input [P, 3] int64 (`plugins/pool_table.py`) and update them in place, MoE receive buffers are
    static (bounded by the recipe's limits) and plugin scratch is a plugin output; otherwise the pools are graph
    inputs and the step's new states and cache rows graph outputs, which the runtime writes back;
    ordered_collectives: every collective node takes one more input, `after` (the graph's previous collective's
    first output; the first one's: its own input), so that every two collectives are ordered by a data path: an
    engine that orders its layers by data dependencies alone runs them in the graph's order, the same on every rank
    (`GraphBuilder.collective`; the ONNX Runtime backend runs them between segments in the graph's order anyway)."""

    compute_dtype: int = TensorProto.FLOAT
    pools_in_place: bool = False
    ordered_collectives: bool = False


def cache_storage_type(kv_cache: str) -> int:
    """ONNX element type of the cache pools for the recipe's `quantization.kv_cache`."""
    if kv_cache not in CACHE_STORAGE:
        raise InputError(f"quantization.kv_cache {kv_cache!r}: the graphs store caches as one of "
                         f"{sorted(CACHE_STORAGE)}")
    return CACHE_STORAGE[kv_cache]

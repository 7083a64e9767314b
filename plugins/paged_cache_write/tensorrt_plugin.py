"""TensorRT quickly-deployable plugin (QDP) for PagedCacheWrite, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the parser's
fields, output type, shape and aliasing, and the `aot_impl` launch parameters with the real Triton compile (cubin and PTX for sm_90).
The kernel itself is tested in the interpreter.

Importing this module registers `moe_export::PagedCacheWrite` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"); it has no attributes of its own.

- `pool_out` is declared *aliased* to `pool` (the builder enables `PreviewFeature.ALIASED_PLUGIN_IO_10_03`): the
  step's rows are written into the runtime's pool in place, O(tokens); the runtime binds the segment output
  `<pool>.written` to the pool's own buffer (`runtime/engine/tensorrt.py`).
- `impl` (JIT) launches the kernel on TensorRT's stream; `aot_impl` compiles it for the target GPU (its cubin, PTX as fallback):
  parameters the 5 input pointers, the int32 extras N, T, NB, BS, B, then the output pointer; grid (T,); the
  row width D must be a build-time constant.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import aot_kernel_code, as_torch, clamp_ragged_indices
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .triton_kernel import aot_compile, paged_cache_write_triton

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_POOL_TYPES = {trt.float32: torch.float32, trt.bfloat16: torch.bfloat16, trt.float16: torch.float16,
               trt.uint8: torch.uint8}  # fmt: skip


@trtp.register(PLUGIN_ID)
def _describe(
    pool: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
) -> trtp.TensorDesc:
    """pool_out aliases pool [NB, BS, W]."""
    return pool.aliased()


@trtp.autotune(PLUGIN_ID)
def _formats(
    pool: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32, bf16 or uint8 (fp8 rows + scale byte) pool and the same output, fp32 new rows, int64 bookkeeping."""
    return [trtp.AutoTuneCombination(f"{pool}, FP32, INT64, INT64, INT64, {pool}") for pool in ("FP32", "BF16", "UINT8")]


@trtp.impl(PLUGIN_ID)
def _run(
    pool: trtp.Tensor,
    new_rows: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    block_tables: trtp.Tensor,
    positions: trtp.Tensor,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Write the rows into the aliased output (the pool's own buffer) on TensorRT's stream."""
    pool_t, new, cu, tables, pos = (as_torch(t) for t in (pool, new_rows, cu_seqlens, block_tables, positions))
    out = as_torch(outputs[0])
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        cu, tables, pos = clamp_ragged_indices(cu, tables, pos, pool_t.shape[0], pool_t.shape[1])
        paged_cache_write_triton(pool_t, new, cu, tables, pos, out=out)


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    pool: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's cubin for the target GPU (PTX as fallback); one program per token."""
    kernel = aot_compile(new_rows.shape_expr[1].constant_value(), target_capability(),
                         _POOL_TYPES.get(pool.dtype, torch.float32))  # fmt: skip
    params = trtp.KernelLaunchParams()
    params.grid_x = new_rows.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(e) for e in (block_tables.shape_expr[0], new_rows.shape_expr[0], pool.shape_expr[0],
                                    pool.shape_expr[1], block_tables.shape_expr[1])]
    )  # fmt: skip
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID), params, extra_args

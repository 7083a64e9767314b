"""TensorRT quickly-deployable plugin (QDP) for PagedCacheWrite, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the parser's
fields, output type and shape (no aliasing), and the `aot_impl` launch parameters with the real Triton compile
(cubin and PTX for sm_90). The kernel itself is tested in the interpreter.

Importing this module registers `moe_export::PagedCacheWrite` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"); fields `pool`, `block_size` (INT32) and `pool_dtype` (CHAR).

- The pool is no tensor of the network: input 0 is the pool table (`plugins/pool_table.py`),
  the kernel writes the step's rows into row `pool`'s pool in place, O(tokens); the output `rows_out` is the rows
  passed on, which the pool's readers take as their new rows (so TensorRT runs them after the write).
- `impl` (JIT) launches the kernel on TensorRT's stream; `aot_impl` compiles it for the target GPU (its PTX,
  `tensorrt_common.aot_kernel_code`): parameters the 5 input pointers, the int32 extras pool, N, T, BS, B, then the rows_out pointer;
  grid (T,); the row width D must be a build-time constant.
"""

import tensorrt as trt  # noqa: F401 - the TensorRT bindings load before tensorrt.plugin
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..pool_table import CACHE_DTYPES
from ..tensorrt_common import Int32Field, aot_kernel_code, as_torch, clamp_ragged_indices, scalar, text
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .triton_kernel import aot_compile, paged_cache_write_launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"


@trtp.register(PLUGIN_ID)
def _describe(
    pool_table: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
) -> trtp.TensorDesc:
    """rows_out like new_rows [T, D] fp32 (no pool output: the pool is written through the table)."""
    return new_rows.like()


@trtp.autotune(PLUGIN_ID)
def _formats(
    pool_table: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """The int64 pool table and bookkeeping, fp32 new rows and output."""
    return [trtp.AutoTuneCombination("INT64, FP32, INT64, INT64, INT64, FP32")]


@trtp.impl(PLUGIN_ID)
def _run(
    pool_table: trtp.Tensor,
    new_rows: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    block_tables: trtp.Tensor,
    positions: trtp.Tensor,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Write the rows into the table's pool and pass them on, on TensorRT's stream."""
    table, new, cu, tables, pos = (as_torch(t) for t in (pool_table, new_rows, cu_seqlens, block_tables, positions))
    bs = scalar(block_size)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        cu, tables, pos = clamp_ragged_indices(cu, tables, pos, bs)
        paged_cache_write_launch(table, scalar(pool), bs, CACHE_DTYPES[text(pool_dtype)], new, cu, tables, pos,
                                 as_torch(outputs[0]))  # fmt: skip


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    pool_table: trtp.TensorDesc,
    new_rows: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's PTX for the target GPU (`tensorrt_common.aot_kernel_code`); one program per token."""
    kernel = aot_compile(new_rows.shape_expr[1].constant_value(), target_capability(), CACHE_DTYPES[text(pool_dtype)])
    params = trtp.KernelLaunchParams()
    params.grid_x = new_rows.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(e) for e in (int(scalar(pool)), block_tables.shape_expr[0], new_rows.shape_expr[0],
                                    int(scalar(block_size)), block_tables.shape_expr[1])]
    )  # fmt: skip
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID, 5 + len(extra_args) + len(outputs)), params, extra_args

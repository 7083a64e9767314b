"""TensorRT quickly-deployable plugin (QDP) for SparseMLAAttention, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields, output types and shapes, and the `aot_impl` launch parameters and int32 extras with the real
Triton compile (cubin and PTX for sm_90). The kernel itself is tested in the interpreter (sparse / dense / K = 0, paged pools, with
the token -> sequence search and the block-table lookup done in the kernel).

Importing this module registers `moe_export::SparseMLAAttention` (name = op type, namespace = the node's
`plugin_namespace` attribute, version "1"); `scale` arrives as one FLOAT32, `kv_lora_rank`, `pool` and
`block_size` as one INT32 each, `pool_dtype` (fp32 / bf16 / fp8) as CHAR bytes. The latent cache is no tensor of
the network: input 1 is the pool table (`plugins/pool_table.py`), field `pool` its row.
QDP input lists are fixed, so the plugin always has seven inputs: the TensorRT graph gives dense-causal layers an
empty [0, 0] int64 `topk_indices`, which the op defines as dense (see `reference.py`).

- `impl` (JIT, needs Python in the engine) launches the kernel on TensorRT's stream.
- `aot_impl` compiles the same kernel for the target GPU and hands TensorRT its PTX
  (`tensorrt_common.aot_kernel_code`). Kernel parameters are the 7 input pointers, then the int32 extras pool
  (the table row), N (= block_tables rows), T (= tokens), BS (= block size), B (= block_tables columns), K
  (= topk_indices columns; 0 makes the kernel dense and leaves `topk_indices` unread), then the output pointer;
  grid (T, cdiv(H, 16)), the kernel's dynamic shared memory declared. H and Dc+Dr must be build-time constants.
  At Dc = 512 the fp32 and fp8 pool forms need more dynamic shared memory than a launch gets without an opt-in
  (~108 KiB, 52 KiB), which TensorRT's AOT launcher is not known to do: their AOT builds are refused with a clear
  message (contract AOT_SHARED_MEMORY_OPT_IN_UNKNOWN) and such engines use the JIT launch (tensorrt.prefer_aot:
  false); the bf16 pool form (16 keys a step, unpipelined: `triton_kernel.aot_key_tiles`) needs 36 KiB and is
  handed over.
  Triton's two scratch parameters are removed from the PTX entry (`tensorrt_common.aot_kernel_code`).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..pool_table import CACHE_DTYPES
from ..tensorrt_common import Float32Field, Int32Field, aot_kernel_code, as_torch, scalar, text
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .triton_kernel import aot_compile, sparse_mla_attention_launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_BLOCK_H = 16  # heads per program of the AOT kernel


@trtp.register(PLUGIN_ID)
def _describe(
    q_lat: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    kv_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk_indices: trtp.TensorDesc,
    scale: Float32Field,
    kv_lora_rank: Int32Field,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
) -> trtp.TensorDesc:
    """o_lat [T, H, kv_lora_rank] fp32 from q_lat [T, H, Dc+Dr]."""
    dims = (q_lat.shape_expr[0], q_lat.shape_expr[1], scalar(kv_lora_rank))
    return trtp.from_shape_expr(dims, dtype=trt.float32)


@trtp.autotune(PLUGIN_ID)
def _formats(
    q_lat: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    kv_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk_indices: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """fp32 activations and new rows, the int64 pool table (the pool's dtype is the `pool_dtype` field) and index
    inputs, linear layout."""
    return [trtp.AutoTuneCombination("FP32, INT64, FP32, INT64, INT64, INT64, INT64, FP32")]


@trtp.impl(PLUGIN_ID)
def _run(
    q_lat: trtp.Tensor,
    pool_table: trtp.Tensor,
    kv_new: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    block_tables: trtp.Tensor,
    positions: trtp.Tensor,
    topk_indices: trtp.Tensor,
    scale: Float32Field,
    kv_lora_rank: Int32Field,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Run the Triton kernel on TensorRT's stream into the output buffer; the pool is read through the table."""
    q, table, new, cu, tables, pos, idx = (as_torch(t) for t in (q_lat, pool_table, kv_new, cu_seqlens, block_tables,
                                                                  positions, topk_indices))  # fmt: skip
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        sparse_mla_attention_launch(q, table, scalar(pool), scalar(block_size), CACHE_DTYPES[text(pool_dtype)], new, cu,
                                    tables, pos, idx if idx.shape[1] else None, as_torch(outputs[0]),
                                    scale=scalar(scale), kv_lora_rank=scalar(kv_lora_rank))  # fmt: skip


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    q_lat: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    kv_new: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    topk_indices: trtp.TensorDesc,
    scale: Float32Field,
    kv_lora_rank: Int32Field,
    pool: Int32Field,
    block_size: Int32Field,
    pool_dtype: str,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's PTX for the target GPU (`tensorrt_common.aot_kernel_code`); H and Dc+Dr must be build-time constants (K3: Dc+Dr = 512+64)."""
    rank = scalar(kv_lora_rank)
    num_heads = q_lat.shape_expr[1].constant_value()
    rope_dim = q_lat.shape_expr[2].constant_value() - rank
    kernel = aot_compile(num_heads, rank, rope_dim, scalar(scale), target_capability(), block_h=_BLOCK_H,
                         pool_dtype=CACHE_DTYPES[text(pool_dtype)])
    params = trtp.KernelLaunchParams()
    params.grid_x = q_lat.shape_expr[0]
    params.grid_y = -(-num_heads // _BLOCK_H)
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple(
        [
            trtp.SymInt32(e)
            for e in (int(scalar(pool)), block_tables.shape_expr[0], q_lat.shape_expr[0], int(scalar(block_size)),
                      block_tables.shape_expr[1], topk_indices.shape_expr[1])
        ]  # fmt: skip
    )
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID, 7 + len(extra_args) + len(outputs)), params, extra_args

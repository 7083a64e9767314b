"""TensorRT quickly-deployable plugin (QDP) for ShortConv, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
parser's fields, output types / shapes / aliasing, and the `aot_impl` launch parameters with the real Triton
compile (cubin and PTX for sm_90). The kernel itself is tested in the interpreter.

Importing this module registers ``moe_export::ShortConv`` (name = op type, namespace = the node's
``plugin_namespace`` attribute, version "1"). The window pool is no tensor of the network: the plugin takes the
pool table (`plugins/pool_table.py`) and its row (field ``pool``), and the kernel writes the N addressed slots in
place (no aliased output). ``impl`` (JIT) launches the kernel on TensorRT's stream;
``aot_impl`` compiles the same kernel for the target GPU (its PTX, entry parameters exactly as TensorRT passes them: `tensorrt_common.aot_kernel_code`): parameters are the 5 input
pointers, the int32 extras pool (the table row) and T (tokens), then the y pointer; grid (cdiv(C, BC), N). Triton's two scratch
parameters are removed from the PTX entry (``tensorrt_common.aot_kernel_code``).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import Int32Field, aot_kernel_code, as_torch, scalar
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .sizes import block_sizes
from .triton_kernel import aot_compile, launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_TRITON_TYPE = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}


@trtp.register(PLUGIN_ID)
def _describe(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    pool: Int32Field,
) -> trtp.TensorDesc:
    """y like x [T, C]; the window pool is written in place through the pool table (no pool output)."""
    return x.like()


@trtp.autotune(PLUGIN_ID)
def _formats(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """x/y fp32, fp16 or bf16; weight fp32; the pool table and index inputs int64; linear."""
    return [trtp.AutoTuneCombination(f"{a}, FP32, INT64, INT64, INT64, {a}") for a in ("FP32", "FP16", "BF16")]


@trtp.impl(PLUGIN_ID)
def _run(
    x: trtp.Tensor,
    weight: trtp.Tensor,
    pool_table: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    pool: Int32Field,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """Launch the Triton kernel on TensorRT's stream; the kernel updates the pool in place through the table."""
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tx, tw, table, cu, slots = (as_torch(t) for t in (x, weight, pool_table, cu_seqlens, slot_ids))
        launch(tx, tw, table, scalar(pool), cu, slots, as_torch(outputs[0]))


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    x: trtp.TensorDesc,
    weight: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    pool: Int32Field,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's PTX for the target GPU (`tensorrt_common.aot_kernel_code`); C and W must be build-time constants (weight is an initializer)."""
    C = weight.shape_expr[0].constant_value()
    W = weight.shape_expr[1].constant_value()
    kernel = aot_compile(_TRITON_TYPE[x.dtype], C, W, target_capability())
    params = trtp.KernelLaunchParams()
    params.grid_x = -(-C // block_sizes(C, W)[1])
    params.grid_y = slot_ids.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(int(scalar(pool))), trtp.SymInt32(x.shape_expr[0])])
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID, 5 + len(extra_args) + len(outputs)), params, extra_args

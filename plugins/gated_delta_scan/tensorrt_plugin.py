"""TensorRT quickly-deployable plugin (QDP) for GatedDeltaScan, backed by the Triton kernel.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the
fields the ONNX parser makes of our node's attributes, output types / shapes / aliasing, and the `aot_impl`
launch parameters with the real Triton compile (cubin and PTX for sm_90). The kernel itself is tested in the interpreter.

Importing this module registers ``moe_export::GatedDeltaScan`` (name = op type, namespace = the node's
``plugin_namespace`` attribute, version "1"); the parser passes the attributes ``scale`` (FLOAT32),
``use_qk_l2norm`` and ``pool`` (INT32) as fields (see ``plugins/tensorrt_common.py`` for why they are 1-element
arrays).

- The state pool is no tensor of the network: the plugin takes the pool table
  (`plugins/pool_table.py`) and its row (field ``pool``); the kernel reads each state tile before writing it,
  in place, and only the N addressed slots are touched. No aliased output.
- ``impl`` (JIT, needs Python in the engine) launches the kernel on TensorRT's stream.
- ``aot_impl`` compiles the same kernel for the target GPU (its PTX, entry parameters exactly as TensorRT passes them: `tensorrt_common.aot_kernel_code`). Kernel parameters: the 8 input pointers,
  the int32 extras pool (the table row) and T (tokens), the o pointer; grid (cdiv(V, BV), H, N). The
  builder chooses JIT or AOT (the plugin has both, so the network must say which). Triton's two scratch
  parameters are removed from the PTX entry (``tensorrt_common.aot_kernel_code``).
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..pool_table import pools_of_table
from ..tensorrt_common import Float32Field, Int32Field, aot_kernel_code, as_torch, scalar
from ..tensorrt_target import target_capability
from .onnx_schema import OP_TYPE
from .fla_path import fla_kernels, kda_pool_fla
from .sizes import block_sizes
from .triton_kernel import aot_compile, launch

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_TRITON_TYPE = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}


@trtp.register(PLUGIN_ID)
def _describe(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    scale: Float32Field,
    use_qk_l2norm: Int32Field,
    pool: Int32Field,
) -> trtp.TensorDesc:
    """o like v [T, H, V]; the state pool is written in place through the pool table (no pool output)."""
    return v.like()


@trtp.autotune(PLUGIN_ID)
def _formats(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    """q, k, v, o share one of fp32/fp16/bf16; g, beta fp32; the pool table and index inputs int64; linear."""
    return [
        trtp.AutoTuneCombination(f"{a}, {a}, {a}, FP32, FP32, INT64, INT64, INT64, {a}")
        for a in ("FP32", "FP16", "BF16")
    ]


@trtp.impl(PLUGIN_ID)
def _run(
    q: trtp.Tensor,
    k: trtp.Tensor,
    v: trtp.Tensor,
    g: trtp.Tensor,
    beta: trtp.Tensor,
    pool_table: trtp.Tensor,
    cu_seqlens: trtp.Tensor,
    slot_ids: trtp.Tensor,
    scale: Float32Field,
    use_qk_l2norm: Int32Field,
    pool: Int32Field,
    outputs: tuple[trtp.Tensor],
    stream: int,
) -> None:
    """On TensorRT's stream: fla's kernels on the runner's pool when they can run (`fla_path`), else our Triton
    kernel, which updates the pool in place through the table."""
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        tq, tk, tv, tg, tb, table, cu, slots = (as_torch(x) for x in (q, k, v, g, beta, pool_table, cu_seqlens, slot_ids))
        pools = pools_of_table(table) if table.is_cuda else None
        if pools is not None and fla_kernels() is not None:
            kda_pool_fla(tq, tk, tv, tg, tb, pools[scalar(pool)], cu, slots, scalar(scale), bool(scalar(use_qk_l2norm)),
                         out=as_torch(outputs[0]))  # fmt: skip
            return
        launch(tq, tk, tv, tg, tb, table, scalar(pool), cu, slots, as_torch(outputs[0]), scalar(scale),
               bool(scalar(use_qk_l2norm)), True)  # fmt: skip


@trtp.aot_impl(PLUGIN_ID)
def _compile(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    g: trtp.TensorDesc,
    beta: trtp.TensorDesc,
    pool_table: trtp.TensorDesc,
    cu_seqlens: trtp.TensorDesc,
    slot_ids: trtp.TensorDesc,
    scale: Float32Field,
    use_qk_l2norm: Int32Field,
    pool: Int32Field,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
    """The kernel's PTX for the target GPU (`tensorrt_common.aot_kernel_code`); H, K, V must be build-time constants (they are for K3: 96/128/128)."""
    H = q.shape_expr[1].constant_value()
    K = q.shape_expr[2].constant_value()
    V = v.shape_expr[2].constant_value()
    kernel = aot_compile(
        _TRITON_TYPE[q.dtype], H, K, V, scalar(scale), bool(scalar(use_qk_l2norm)), True, target_capability()
    )
    params = trtp.KernelLaunchParams()
    params.grid_x = -(-V // block_sizes(K, V)[1])
    params.grid_y = H
    params.grid_z = slot_ids.shape_expr[0]
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(int(scalar(pool))), trtp.SymInt32(q.shape_expr[0])])
    return kernel.metadata.name, aot_kernel_code(kernel, PLUGIN_ID, 8 + len(extra_args) + len(outputs)), params, extra_args

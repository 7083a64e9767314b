"""TensorRT quickly-deployable plugins (QDP) for the collectives AllReduce, AllGather, MoEDispatch and MoECombine,
inside each rank's engine.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the parser's
fields, output types and shapes, and the build-time no-op.

Importing this module registers `moe_export::AllReduce` (fields `group`, `reduce_op`) and `moe_export::AllGather`
(fields `group`, `axis`, `group_size`; the gathered dim is `group_size` times the input's, so the output shape is
known at build time). The design, as TensorRT-LLM's NCCL plugins (contract PLUGIN_RUNS_WHILE_BUILDING):
  - while the engine is being built (`nccl.is_building()`, set by `export/backends/tensorrt/engine.py` around
    `build_serialized_network`) the impl returns at once: TensorRT times plugins with garbage, and every rank
    builds on its own;
  - at run time the impl takes the communicator its `group` field names (registered by the runner from MPI:
    `nccl.set_communicators`) and runs the collective on TensorRT's stream, writing into the output buffer.
`moe_export::MoEDispatch` (fields `group`, `num_experts`, `group_size`, `max_recv_rows`) and `moe_export::MoECombine`
(field `group`) are the `dp` layout's all-to-alls with static shapes: recv_x [max_recv_rows, D], recv_ids /
recv_w [max_recv_rows, K], send_rows [T * K], send_counts / recv_counts [group_size]; the combine's output has the
dispatched tokens' shape. At run time the received rows fill the head of the buffers and only they are computed
(`nccl.Communicator.moe_dispatch`: the counted transport in eager steps, fixed blocks without a host value in
decode steps, which CUDA graphs replay; the README's Parallelism section says how the bound is set and what it
costs).
Each of the four takes a last input `after` (the graph's previous collective's first output; never read): TensorRT
orders layers by data dependencies alone (contract TRT_ORDERS_BY_DATA_DEPENDENCIES), so that path is what makes
every rank's engine run its collectives in the graph's order, as NCCL requires of each communicator.
One engine per rank, the collectives inside: no segment boundaries, one enqueue per step. The JIT impl needs
Python in the engine (as every plugin here has). The ONNX Runtime backend keeps cutting the graph at these nodes.
"""

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import Int32Field, as_torch, scalar, text
from .nccl import communicator, is_building

ALL_REDUCE = f"{PLUGIN_NAMESPACE}::AllReduce"
ALL_GATHER = f"{PLUGIN_NAMESPACE}::AllGather"
_FLOATS = ("FP32", "FP16", "BF16")


@trtp.register(ALL_REDUCE)
def _describe_reduce(x: trtp.TensorDesc, after: trtp.TensorDesc, group: str, reduce_op: str) -> trtp.TensorDesc:
    """y like x; only `sum` is defined (an unknown reduction fails the build here)."""
    if text(reduce_op) != "sum":
        raise ValueError(f"{ALL_REDUCE}: reduce_op must be 'sum', got {text(reduce_op)!r}")
    return x.like()


@trtp.autotune(ALL_REDUCE)
def _reduce_formats(x: trtp.TensorDesc, after: trtp.TensorDesc,
                    outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:  # fmt: skip
    """Input and output share one of fp32 / fp16 / bf16, `after` any of them; linear."""
    return [trtp.AutoTuneCombination(f"{t}, {a}, {t}") for t in _FLOATS for a in _FLOATS]


@trtp.impl(ALL_REDUCE)
def _run_reduce(x: trtp.Tensor, after: trtp.Tensor, group: str, reduce_op: str, outputs: tuple[trtp.Tensor],
                stream: int) -> None:  # fmt: skip
    """Nothing while building; else the group's NCCL all-reduce on TensorRT's stream into the output."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.all_reduce(as_torch(x), as_torch(outputs[0]))


@trtp.register(ALL_GATHER)
def _describe_gather(x: trtp.TensorDesc, after: trtp.TensorDesc, group: str, axis: Int32Field,
                     group_size: Int32Field) -> trtp.TensorDesc:  # fmt: skip
    """y = x with dim `axis` times group_size."""
    rank = len(x.shape_expr)
    a = scalar(axis) % rank
    dims = [x.shape_expr[i] * scalar(group_size) if i == a else x.shape_expr[i] for i in range(rank)]
    return trtp.from_shape_expr(tuple(dims), dtype=x.dtype)


@trtp.autotune(ALL_GATHER)
def _gather_formats(x: trtp.TensorDesc, after: trtp.TensorDesc,
                    outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:  # fmt: skip
    """Input and output share one of fp32 / fp16 / bf16, `after` any of them; linear."""
    return [trtp.AutoTuneCombination(f"{t}, {a}, {t}") for t in _FLOATS for a in _FLOATS]


@trtp.impl(ALL_GATHER)
def _run_gather(x: trtp.Tensor, after: trtp.Tensor, group: str, axis: Int32Field, group_size: Int32Field,
                outputs: tuple[trtp.Tensor], stream: int) -> None:  # fmt: skip
    """Nothing while building; else the group's NCCL all-gather on TensorRT's stream into the output."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.all_gather(as_torch(x), as_torch(outputs[0]), scalar(axis))



MOE_DISPATCH = f"{PLUGIN_NAMESPACE}::MoEDispatch"
MOE_COMBINE = f"{PLUGIN_NAMESPACE}::MoECombine"
_DispatchOut = tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]
_DispatchBuffers = tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor, trtp.Tensor, trtp.Tensor, trtp.Tensor]


@trtp.register(MOE_DISPATCH)
def _describe_dispatch(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, expert_weights: trtp.TensorDesc,
                       after: trtp.TensorDesc, group: str, num_experts: Int32Field, group_size: Int32Field,
                       max_recv_rows: Int32Field) -> _DispatchOut:  # fmt: skip
    """recv_x [R, D] like x, recv_ids [R, K] int64, recv_w [R, K] fp32 (R = max_recv_rows, the static bound),
    send_rows [T * K] int64 (where each token's choice comes back in the combine), send_counts / recv_counts
    [group_size] int64. A bound of 0 (a graph exported for ONNX
    Runtime, whose receive buffers are exact) or experts not divisible by the group fail the build here."""
    rows, ep, experts = scalar(max_recv_rows), scalar(group_size), scalar(num_experts)
    if rows <= 0:
        raise ValueError(f"{MOE_DISPATCH}: max_recv_rows must be positive (got {rows}): export the graph for "
                         "backend tensorrt, which sets the receive bound")
    if ep <= 0 or experts % ep:
        raise ValueError(f"{MOE_DISPATCH}: num_experts={experts} is not split evenly over group_size={ep}")
    tokens, width, top_k = x.shape_expr[0], x.shape_expr[1], expert_ids.shape_expr[1]
    return (trtp.from_shape_expr((rows, width), dtype=x.dtype),
            trtp.from_shape_expr((rows, top_k), dtype=trt.int64),
            trtp.from_shape_expr((rows, top_k), dtype=trt.float32),
            trtp.from_shape_expr((tokens * top_k,), dtype=trt.int64),
            trtp.from_shape_expr((ep,), dtype=trt.int64),
            trtp.from_shape_expr((ep,), dtype=trt.int64))  # fmt: skip


@trtp.autotune(MOE_DISPATCH)
def _dispatch_formats(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, expert_weights: trtp.TensorDesc,
                      after: trtp.TensorDesc, outputs: _DispatchOut) -> list[trtp.AutoTuneCombination]:  # fmt: skip
    """Activations in fp32 / fp16 / bf16 (the received rows alike, `after` any of them), int64 ids, rows and
    counts, fp32 weights."""
    return [trtp.AutoTuneCombination(f"{t}, INT64, FP32, {a}, {t}, INT64, FP32, INT64, INT64, INT64")
            for t in _FLOATS for a in _FLOATS]


@trtp.impl(MOE_DISPATCH)
def _run_dispatch(x: trtp.Tensor, expert_ids: trtp.Tensor, expert_weights: trtp.Tensor, after: trtp.Tensor,
                  group: str, num_experts: Int32Field, group_size: Int32Field, max_recv_rows: Int32Field,
                  outputs: _DispatchBuffers, stream: int) -> None:  # fmt: skip
    """Nothing while building; else the group's all-to-all dispatch on TensorRT's stream into the outputs."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.moe_dispatch(as_torch(x), as_torch(expert_ids), as_torch(expert_weights), scalar(num_experts),
                          tuple(as_torch(t) for t in outputs))  # fmt: skip


@trtp.register(MOE_COMBINE)
def _describe_combine(partial: trtp.TensorDesc, send_rows: trtp.TensorDesc, send_counts: trtp.TensorDesc,
                      recv_counts: trtp.TensorDesc, x: trtp.TensorDesc, after: trtp.TensorDesc,
                      group: str) -> trtp.TensorDesc:  # fmt: skip
    """y [T, D]: the dispatched tokens' rows, the partial sums' width and type."""
    return trtp.from_shape_expr((x.shape_expr[0], partial.shape_expr[1]), dtype=partial.dtype)


@trtp.autotune(MOE_COMBINE)
def _combine_formats(partial: trtp.TensorDesc, send_rows: trtp.TensorDesc, send_counts: trtp.TensorDesc,
                     recv_counts: trtp.TensorDesc, x: trtp.TensorDesc, after: trtp.TensorDesc,
                     outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:  # fmt: skip
    """Partial sums, tokens and output share one of fp32 / fp16 / bf16, `after` any of them; int64 rows and
    counts."""
    return [trtp.AutoTuneCombination(f"{t}, INT64, INT64, INT64, {t}, {a}, {t}") for t in _FLOATS for a in _FLOATS]


@trtp.impl(MOE_COMBINE)
def _run_combine(partial: trtp.Tensor, send_rows: trtp.Tensor, send_counts: trtp.Tensor, recv_counts: trtp.Tensor,
                 x: trtp.Tensor, after: trtp.Tensor, group: str, outputs: tuple[trtp.Tensor],
                 stream: int) -> None:  # fmt: skip
    """Nothing while building; else the group's all-to-all combine on TensorRT's stream into the output."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.moe_combine(as_torch(partial), as_torch(send_rows), as_torch(send_counts), as_torch(recv_counts),
                         as_torch(outputs[0]))

"""TensorRT quickly-deployable plugins (QDP) for the collectives AllReduce and AllGather, inside each rank's engine.

NOT RUN ON A GPU HERE: TensorRT's libraries cannot be installed on this project's machines. What runs here
(`tests/test_tensorrt_plugins.py`): this module under TensorRT's real pure-Python `tensorrt.plugin` package
(10.9 and 11.4 bindings wheels) over a stand-in of the compiled core: registration, creation from the parser's
fields, output types and shapes, and the build-time no-op.

Importing this module registers `moe_export::AllReduce` (fields `group`, `reduce_op`) and `moe_export::AllGather`
(fields `group`, `axis`, `group_size`; the gathered dim is `group_size` times the input's, so the output shape is
known at build time). The design, as TensorRT-LLM's NCCL plugins (contract PLUGIN_RUNS_WHILE_BUILDING):
  - while the engine is being built (`nccl.is_building()`, set by `export/tensorrt_build.py` around
    `build_serialized_network`) the impl returns at once: TensorRT times plugins with garbage, and every rank
    builds on its own;
  - at run time the impl takes the communicator its `group` field names (registered by the runner from MPI:
    `nccl.set_communicators`) and runs the collective on TensorRT's stream, writing into the output buffer.
One engine per rank, the collectives inside: no segment boundaries, one enqueue per step. The JIT impl needs
Python in the engine (as every plugin here has). The ONNX Runtime backend keeps cutting the graph at these nodes.
"""

import tensorrt.plugin as trtp
import torch

from .. import PLUGIN_NAMESPACE
from ..tensorrt_common import Int32Field, as_torch, scalar, text
from .nccl import communicator, is_building

ALL_REDUCE = f"{PLUGIN_NAMESPACE}::AllReduce"
ALL_GATHER = f"{PLUGIN_NAMESPACE}::AllGather"
_FLOATS = ("FP32", "FP16", "BF16")


@trtp.register(ALL_REDUCE)
def _describe_reduce(x: trtp.TensorDesc, group: str, reduce_op: str) -> trtp.TensorDesc:
    """y like x; only `sum` is defined (an unknown reduction fails the build here)."""
    if text(reduce_op) != "sum":
        raise ValueError(f"{ALL_REDUCE}: reduce_op must be 'sum', got {text(reduce_op)!r}")
    return x.like()


@trtp.autotune(ALL_REDUCE)
def _reduce_formats(x: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
    """Input and output share one of fp32 / fp16 / bf16; linear."""
    return [trtp.AutoTuneCombination(f"{t}, {t}") for t in _FLOATS]


@trtp.impl(ALL_REDUCE)
def _run_reduce(x: trtp.Tensor, group: str, reduce_op: str, outputs: tuple[trtp.Tensor], stream: int) -> None:
    """Nothing while building; else the group's NCCL all-reduce on TensorRT's stream into the output."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.all_reduce(as_torch(x), as_torch(outputs[0]))


@trtp.register(ALL_GATHER)
def _describe_gather(x: trtp.TensorDesc, group: str, axis: Int32Field, group_size: Int32Field) -> trtp.TensorDesc:
    """y = x with dim `axis` times group_size."""
    rank = len(x.shape_expr)
    a = scalar(axis) % rank
    dims = [x.shape_expr[i] * scalar(group_size) if i == a else x.shape_expr[i] for i in range(rank)]
    return trtp.from_shape_expr(tuple(dims), dtype=x.dtype)


@trtp.autotune(ALL_GATHER)
def _gather_formats(x: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
    """Input and output share one of fp32 / fp16 / bf16; linear."""
    return [trtp.AutoTuneCombination(f"{t}, {t}") for t in _FLOATS]


@trtp.impl(ALL_GATHER)
def _run_gather(x: trtp.Tensor, group: str, axis: Int32Field, group_size: Int32Field, outputs: tuple[trtp.Tensor],
                stream: int) -> None:  # fmt: skip
    """Nothing while building; else the group's NCCL all-gather on TensorRT's stream into the output."""
    if is_building():
        return
    comm = communicator(text(group))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        comm.all_gather(as_torch(x), as_torch(outputs[0]), scalar(axis))


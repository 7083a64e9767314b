"""TensorRT quickly-deployable plugins (QDP) for AllReduce / AllGather over NCCL.

NOT EXERCISED HERE: TensorRT cannot be installed on this project's machines (see README), so this
module has never been imported or run. It follows the QDP API (`tensorrt.plugin`) as read from
TensorRT's public sources. Importing it registers `moe_export::AllReduce` and
`moe_export::AllGather`, which TensorRT's ONNX parser binds to the graph's collective nodes.

The impls use torch.distributed's NCCL process groups, which the GPU runtime creates before loading
engines (one group per tp and per ep group, ranks grouped as in `graphs.sharding.Mapping`) and
publishes through `set_process_groups`. They run on TensorRT's stream, so the collective is ordered
with the engine's kernels. Only JIT impls exist (NCCL calls are host-driven), so engines that contain
collectives need Python at run time, as TensorRT-LLM's Python runtime does.
"""

import tensorrt.plugin as trtp
import torch
import torch.distributed as dist

from .. import PLUGIN_NAMESPACE

_GROUPS: dict[str, "dist.ProcessGroup"] = {}


def set_process_groups(tp_group: "dist.ProcessGroup", ep_group: "dist.ProcessGroup") -> None:
    """Publish this rank's NCCL groups; call before deserializing an engine."""
    _GROUPS["tp"], _GROUPS["ep"] = tp_group, ep_group


@trtp.register(f"{PLUGIN_NAMESPACE}::AllReduce")
def _reduce_desc(x: trtp.TensorDesc, group: str, reduce_op: str) -> trtp.TensorDesc:
    """Same shape and type as x."""
    return x.like()


@trtp.impl(f"{PLUGIN_NAMESPACE}::AllReduce")
def _reduce_impl(x: trtp.Tensor, group: str, reduce_op: str, outputs: tuple[trtp.Tensor], stream: int) -> None:
    src = torch.as_tensor(x, device="cuda")
    out = torch.as_tensor(outputs[0], device="cuda")
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        out.copy_(src)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_GROUPS[group])


@trtp.register(f"{PLUGIN_NAMESPACE}::AllGather")
def _gather_desc(x: trtp.TensorDesc, group: str, axis: int) -> trtp.TensorDesc:
    """x with dimension `axis` multiplied by the group size (known when the engine is built)."""
    size = dist.get_world_size(_GROUPS[group])
    dims = list(x.shape_expr)
    dims[axis] = dims[axis] * size
    return trtp.from_shape_expr(tuple(dims), dtype=x.dtype)


@trtp.impl(f"{PLUGIN_NAMESPACE}::AllGather")
def _gather_impl(x: trtp.Tensor, group: str, axis: int, outputs: tuple[trtp.Tensor], stream: int) -> None:
    src = torch.as_tensor(x, device="cuda")
    out = torch.as_tensor(outputs[0], device="cuda")
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        parts = list(torch.empty((dist.get_world_size(_GROUPS[group]), *src.shape), dtype=src.dtype,
                                 device=src.device).unbind(0))
        dist.all_gather(parts, src.contiguous(), group=_GROUPS[group])
        out.copy_(torch.cat(parts, dim=axis))



"""The communicators the in-engine collective plugins use (TensorRT backend), and the build-time switch.

The TensorRT backend builds one engine per rank with its collectives inside, as TensorRT-LLM does: each
`AllReduce` / `AllGather` node is a plugin (`tensorrt_plugin.py`) whose field `group` names the process group
("tp" or "ep"). While TensorRT builds the engine the plugins do nothing (`is_building()`: TensorRT runs plugins
to time tactics, and ranks build independently, so a collective then would hang; contract
PLUGIN_RUNS_WHILE_BUILDING, TensorRT-LLM `isBuilding()`). At run time the runner registers one `Communicator`
per group (`set_communicators`) before it deserializes the engine; the plugins look theirs up by name and run
NCCL on TensorRT's stream. The communicators are torch.distributed NCCL groups whose rendezvous comes from MPI
(rank 0's address is broadcast over MPI.COMM_WORLD; `runtime/engine/tensorrt.py`).

Other collectives (all-to-all dispatch / combine for wide EP) follow the same pattern: a QDP plugin with a
`group` field, a no-op while building, a method here that runs on the given stream. The wide-EP methods exist
(`Communicator.moe_dispatch` / `moe_combine`, tested over gloo); their plugins do not yet (README, Parallelism).

No tensorrt import here: the communicators and the switch are tested on CPU with torch.distributed's gloo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_state = {"building": False}
_communicators: dict[str, Communicator] = {}


def is_building() -> bool:
    """True while this process builds a TensorRT engine (the collective plugins then return at once)."""
    return _state["building"]


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Mark this process as building an engine for the duration (TensorRT-LLM sets IS_BUILDING likewise)."""
    before = _state["building"]
    _state["building"] = True
    try:
        yield
    finally:
        _state["building"] = before


def set_communicators(communicators: dict[str, Communicator]) -> None:
    """Register the run's communicators by group name (replacing any registered before)."""
    _communicators.clear()
    _communicators.update(communicators)


def communicator(group: str) -> Communicator:
    """The communicator of `group`; a RuntimeError when the runner registered none (an engine run outside
    `runtime/engine/tensorrt.py`, or a world of 1 built with collectives)."""
    if group not in _communicators:
        raise RuntimeError(f"collective plugin: no communicator for group {group!r} (registered: "
                           f"{sorted(_communicators)}); engines with collectives run under the TensorRT runner")
    return _communicators[group]


def concat_gathered(gathered: torch.Tensor, axis: int) -> torch.Tensor:
    """[G, *shape] (rank-major, as all_gather_into_tensor lays out the ranks' tensors) -> the concatenation of
    the G parts along `axis` of `shape`."""
    ndim = gathered.dim() - 1
    axis %= ndim
    moved = gathered.movedim(0, axis)  # [..., G, shape[axis], ...]
    shape = list(moved.shape)
    return moved.reshape(shape[:axis] + [shape[axis] * shape[axis + 1]] + shape[axis + 2 :])


class Communicator:
    """One process group (torch.distributed), its collectives written into caller-provided outputs on the
    current stream (the plugin enters TensorRT's stream first)."""

    def __init__(self, group, size: int):
        import torch.distributed as dist

        self.group, self.size, self._dist = group, size, dist

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = sum over the group of x (out may be x)."""
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        self._dist.all_reduce(out, group=self.group)

    def all_gather(self, x: torch.Tensor, out: torch.Tensor, axis: int) -> None:
        """out = the group's x concatenated along `axis`, in rank order."""
        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        self._dist.all_gather(list(parts.unbind(0)), x.contiguous(), group=self.group)
        out.copy_(concat_gathered(parts, axis))

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int):
        """MoEDispatch over this group (`all_to_all.torch_dispatch`): recv_x, recv_ids, recv_w, layout."""
        from .all_to_all import torch_dispatch

        return torch_dispatch(self.group, x, ids, weights, num_experts)

    def moe_combine(self, y: torch.Tensor, layout, num_tokens: int) -> torch.Tensor:
        """MoECombine over this group (`all_to_all.torch_combine`): [num_tokens, D]."""
        from .all_to_all import torch_combine

        return torch_combine(self.group, y, layout, num_tokens)

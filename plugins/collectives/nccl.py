"""The communicators the in-engine collective plugins use (TensorRT backend), and the build-time switch.

The TensorRT backend builds one engine per rank with its collectives inside, as TensorRT-LLM does: each
`AllReduce` / `AllGather` node is a plugin (`tensorrt_plugin.py`) whose field `group` names the process group
("tp" or "ep"). While TensorRT builds the engine the plugins do nothing (`is_building()`: TensorRT runs plugins
to time tactics, and ranks build independently, so a collective then would hang; contract
PLUGIN_RUNS_WHILE_BUILDING, TensorRT-LLM `isBuilding()`). At run time the runner registers one `Communicator`
per group (`set_communicators`) before it deserializes the engine; the plugins look theirs up by name and run
NCCL on TensorRT's stream. The communicators are torch.distributed NCCL groups whose rendezvous comes from MPI
(rank 0's address is broadcast over MPI.COMM_WORLD; `runtime/engine/tensorrt.py`).

The wide-EP all-to-alls (`MoEDispatch` / `MoECombine`, the `dp` layout) follow the same pattern: QDP plugins
with a `group` field, no-ops while building, `Communicator.moe_dispatch` / `moe_combine` at run time into the
plugins' static output buffers (`all_to_all.torch_dispatch_into`: counts first on the device, one read-back of
the counts, exact rows). The communicator carries what the runner tells it about the step (`idle`: the rank's
attention group has nothing to run, so its dispatch sends no row) and what the dispatches saw (`expert_counts`:
tokens routed to each expert, one list per MoE layer in order).

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
        self.idle = False  # set by the runner for an idle step of this rank's attention group (dp layout)
        self.expert_counts: list[list[int]] = []  # tokens routed to each expert, per dispatch since the last clear
        self._pending: dict[int, tuple[list[int], list[int]]] = {}  # the last dispatch: send_counts buffer -> counts

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

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     outputs: tuple[torch.Tensor, ...]) -> None:
        """MoEDispatch over this group into the plugin's static outputs (`all_to_all.torch_dispatch_into`); keeps
        the host counts for the matching combine (keyed by its send_counts buffer; only the last dispatch's) and the per-expert counts."""
        from .all_to_all import torch_dispatch_into

        sends, recvs, per_expert = torch_dispatch_into(self.group, self.size, x, ids, weights, num_experts, outputs,
                                                       idle=self.idle)
        self._pending = {outputs[4].data_ptr(): (sends, recvs)}  # layers alternate dispatch, combine
        self.expert_counts.append(per_expert)

    def moe_combine(self, partial: torch.Tensor, send_rows: torch.Tensor, send_counts: torch.Tensor,
                    recv_counts: torch.Tensor, out: torch.Tensor) -> None:
        """MoECombine over this group into `out` [T, D]: the host counts of the dispatch that wrote `send_counts`,
        or, if TensorRT handed a copy of that buffer, the counts read back again (one more host sync)."""
        from .all_to_all import torch_combine_into

        counts = self._pending.pop(send_counts.data_ptr(), None)
        if counts is None:
            counts = (send_counts.tolist(), recv_counts.tolist())
        torch_combine_into(self.group, partial, send_rows, *counts, out)

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
plugins' static output buffers (`all_to_all.torch_dispatch_into`: the counted transport with one read-back of
the counts, or fixed blocks with none). The communicator carries what the runner tells it about the step
(`begin_step`: the real tokens of the rank's share, 0 for an idle group, and the transport) and what the
dispatches saw (`routed`: tokens routed to each expert, per MoE layer, on the device).

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
    current stream (the plugin enters TensorRT's stream first).

    The MoE all-to-alls (ep group) also carry the step's state the runner sets (`begin_step`): the tokens of
    this rank's share that are real (a device value, so a captured CUDA graph reads each replay's), and the
    transport (`block_rows`: 0 counted, B > 0 blocks of B rows per peer; see `all_to_all`). Between a dispatch
    and its combine, `recv_bound` is what the host knows of the rows received (B x ep, or the exact count), the
    expert op's chunk bound; `routed` [layers, E] holds the tokens routed to each expert by each dispatch of the
    step, on the device."""

    def __init__(self, group, size: int):
        import torch.distributed as dist

        self.group, self.size, self._dist = group, size, dist
        self.block_rows = 0
        self.recv_bound: int | None = None
        self.routed = None  # [dispatching layers, E] int64 on the device (`reserve`)
        self._valid = self._valid_host = None
        self._layer = 0
        self._pending: dict[int, tuple[list[int], list[int]] | None] = {}  # send_counts buffer -> host counts

    def reserve(self, device, layers: int, num_experts: int) -> None:
        """The device buffers of the MoE all-to-alls' step state, made once (CUDA graphs keep their addresses)."""
        self._valid = torch.zeros(1, dtype=torch.int64, device=device)
        self._valid_host = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.routed = torch.zeros((max(layers, 1), num_experts), dtype=torch.int64, device=device)

    def begin_step(self, valid_tokens: int, block_rows: int) -> None:
        """Before a step's enqueue (or graph replay), on its stream: the real tokens of this rank's share (rows of
        its dispatch input from the first; 0 for an idle group) and the step's transport."""
        if self._valid is None:
            raise RuntimeError("Communicator.reserve must run before the first MoE step")
        self._valid_host.fill_(valid_tokens)
        self._valid.copy_(self._valid_host, non_blocking=True)
        self.block_rows, self._layer = block_rows, 0

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
        """MoEDispatch over this group into the plugin's static outputs (`all_to_all.torch_dispatch_into`) with the
        step's state; keeps the host counts (counted transport) for the matching combine, keyed by its
        send_counts buffer, and the layer's routed tokens."""
        from .all_to_all import torch_dispatch_into

        if self._valid is None:
            raise RuntimeError("Communicator.reserve and begin_step must run before a MoE dispatch")
        if self._layer >= self.routed.shape[0]:
            raise RuntimeError(f"MoEDispatch: more dispatches in a step than the {self.routed.shape[0]} reserved")
        counts = torch_dispatch_into(self.group, self.size, x, ids, weights, num_experts, outputs, valid=self._valid,
                                     routed=self.routed[self._layer], block_rows=self.block_rows)  # fmt: skip
        self._pending = {outputs[4].data_ptr(): counts}  # layers alternate dispatch, combine
        self.recv_bound = self.size * self.block_rows if counts is None else sum(counts[1])
        self._layer += 1

    def moe_combine(self, partial: torch.Tensor, send_rows: torch.Tensor, send_counts: torch.Tensor,
                    recv_counts: torch.Tensor, out: torch.Tensor) -> None:
        """MoECombine over this group into `out` [T, D] with the matching dispatch's transport: blocks, or the
        host counts of the dispatch that wrote `send_counts` (if TensorRT handed a copy of that buffer, the counts
        read back again: one more host sync)."""
        from .all_to_all import torch_combine_into

        self.recv_bound = None
        if self.block_rows:
            torch_combine_into(self.group, partial, send_rows, recv_counts, out, block_rows=self.block_rows)
            return
        counts = self._pending.pop(send_counts.data_ptr(), None)
        if counts is None:
            counts = (send_counts.tolist(), recv_counts.tolist())
        torch_combine_into(self.group, partial, send_rows, recv_counts, out, counts=counts)


def received_rows_bound() -> int | None:
    """Rows the ep group's pending dispatch can have placed at the head of its receive buffers, as the host knows
    it (None outside a dispatch .. combine: the expert op then takes all of its input rows)."""
    comm = _communicators.get("ep")
    return None if comm is None else comm.recv_bound

"""Collectives of the torch runner: what a rank's step asks for, and the two ways a world answers.

A rank's step (`torch_model.RankModel.step`) is a generator: at each collective it yields a request (`AllReduce`,
`AllGather`, `Dispatch`, `Combine`, in graph order as `graphs/onnx_export.py` places the nodes) and is resumed
with the result. Two worlds answer:
  - `run_in_process`: every rank of the world in this process, resumed in lockstep; a request is answered when
    every member of its group has asked it (sums in rank order, the order the ONNX Runtime engine adds in);
  - `DistributedWorld`: one rank per process over torch.distributed (NCCL on GPUs, gloo on CPU), its tp and ep
    groups of consecutive ranks, formed by `common.mpi.torch_group_comms` (the one rendezvous, as the TensorRT
    runner's).
The MoE all-to-all follows `plugins/collectives/all_to_all.py`: each token goes once to every rank holding one of
its experts (rows by destination, then token), counts first so the rows move exactly, and the combine adds the
returned rows per token in destination-rank order.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from moe_export.common.mapping import Mapping
from moe_export.common.mpi import torch_group_comms
from moe_export.plugins.collectives.all_to_all import ID_WIRE_DTYPE, DispatchLayout, send_plan


@dataclass
class AllReduce:
    x: torch.Tensor
    group: str  # "tp" | "ep"


@dataclass
class AllGather:
    x: torch.Tensor
    group: str
    axis: int


@dataclass
class Dispatch:
    """MoEDispatch over the ep group: x [T, W], ids [T, k] global expert ids, weights [T, k] fp32 ->
    (recv_x [R, W], recv_ids [R, k], recv_w [R, k], DispatchLayout)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    group: str = "ep"


@dataclass
class Combine:
    """MoECombine over the ep group: partial [R, W] in receive order -> [num_tokens, W] per source token."""

    partial: torch.Tensor
    layout: DispatchLayout
    num_tokens: int
    group: str = "ep"


Request = AllReduce | AllGather | Dispatch | Combine
Step = Generator[Request, object, object]


def _combine_rows(num_tokens: int, partial_back: torch.Tensor, send_rows: np.ndarray) -> torch.Tensor:
    """The returned rows [S, W] added per token at `send_rows` (in row order: destination-rank order)."""
    out = torch.zeros((num_tokens, partial_back.shape[1]), dtype=partial_back.dtype, device=partial_back.device)
    return out.index_add_(0, torch.from_numpy(send_rows).to(out.device), partial_back)


def _answer_group(reqs: list[Request], num_experts: int, counts: list) -> list:
    """The results of one group's matching requests (members in rank order)."""
    first = reqs[0]
    if isinstance(first, AllReduce):
        total = first.x.clone()
        for r in reqs[1:]:
            total += r.x
        return [total] * len(reqs)
    if isinstance(first, AllGather):
        return [torch.cat([r.x for r in reqs], dim=first.axis)] * len(reqs)
    ep = len(reqs)
    if isinstance(first, Dispatch):
        plans = [send_plan(r.ids.cpu().numpy(), num_experts, ep) for r in reqs]
        counts.append(sum(np.bincount(r.ids.cpu().numpy().ravel(), minlength=num_experts) for r in reqs))
        out = []
        for dst in range(ep):
            picks = []
            for (rows, sends), r in zip(plans, reqs):
                start = int(sends[:dst].sum())
                picks.append(torch.from_numpy(rows[start:start + int(sends[dst])]).to(r.x.device))
            recv_counts = np.array([int(p[1][dst]) for p in plans], dtype=np.int64)
            out.append(tuple(torch.cat([getattr(r, f)[p] for r, p in zip(reqs, picks)])
                             for f in ("x", "ids", "weights")) + (DispatchLayout(*plans[dst], recv_counts),))
        return out
    out = []
    for src, r in enumerate(reqs):
        back = []
        for dst in range(ep):  # the rows dst received from src, in the order src sent them
            start = int(reqs[dst].layout.recv_counts[:src].sum())
            back.append(reqs[dst].partial[start:start + int(reqs[dst].layout.recv_counts[src])])
        out.append(_combine_rows(r.num_tokens, torch.cat(back), r.layout.send_rows))
    return out


def run_in_process(steps: dict[int, Step], tp: int, ep: int, num_experts: int, counts: list) -> dict[int, object]:
    """Run every rank's step of a world in this process (ranks 0..world-1, some may be idle generators); the
    collectives are answered when each group's members have all asked. `counts` gets the tokens routed to each
    expert, one array per dispatch. Returns each rank's step result."""
    live, pending, send, results = dict(steps), {}, dict.fromkeys(steps), {}
    while live:
        for r in sorted(live):
            if r in pending:
                continue
            try:
                pending[r] = live[r].send(send.pop(r))
            except StopIteration as stop:
                results[r] = stop.value
                del live[r]
        answered = False
        for r in sorted(pending):
            req = pending.get(r)
            if req is None:
                continue
            size = tp if req.group == "tp" else ep
            members = range(r - r % size, r - r % size + size)
            if all(type(pending.get(m)) is type(req) and pending[m].group == req.group for m in members):
                for m, result in zip(members, _answer_group([pending.pop(m) for m in members], num_experts, counts)):
                    send[m] = result
                answered = True
        if live and not answered and len(pending) == len(live):
            raise RuntimeError(f"collectives out of step: {sorted((r, type(q).__name__) for r, q in pending.items())}")
    return results


@dataclass
class DeviceLayout:
    """A dispatch on the device transport (`all_to_all.torch_dispatch_into`), for its experts and its combine: the
    returned row of each (token, choice) (`send_rows` [T*K] int64), the counts (on the device) and what the host
    knows of the rows received (`row_bound`: B x ep for blocks, the exact count for the counted transport)."""

    send_rows: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    row_bound: int

    def expert_bounds(self) -> dict:
        """The expert op's bounds (`moe_mxfp4_triton`): the head sum(recv_counts) rows, read on the device."""
        return {"recv_counts": self.recv_counts, "row_bound": self.row_bound}


class DistributedWorld:
    """One rank per process over torch.distributed: the tp and ep groups of this rank (consecutive ranks).

    The MoE all-to-alls (dp layout) run on the host's plan (`send_plan`, exact split sizes: the CPU path, the ONNX
    Runtime engine's order) until `use_device_transport`: then on the device, as the TensorRT runner's plugins
    (`nccl.Communicator`: Triton routing and packing, NCCL all-to-alls), in blocks of `begin_step`'s rows per peer
    with no host read (decode steps, which CUDA graphs replay) or counted with one read-back (other steps)."""

    def __init__(self, mapping: Mapping, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.device = dist, mapping.rank, device
        self.groups = torch_group_comms(mapping, "nccl" if device.type == "cuda" else "gloo", device)
        self.sizes = {"tp": mapping.tp, "ep": mapping.ep}
        self.ep_comm = None  # the device transport's communicator (`use_device_transport`)

    def use_device_transport(self, moe_layers: int, num_experts: int, recv_rows: int, width: int, top_k: int,
                             act: torch.dtype) -> None:
        """The MoE all-to-alls on the device from now on, into receive buffers of `recv_rows` rows
        (`Mapping.max_recv_rows`) made here once and reused by every MoE layer; the tokens routed to each expert
        stay on the device (`ep_comm.routed` [moe_layers, E])."""
        from moe_export.plugins.collectives.nccl import Communicator

        dev, ep = self.device, self.sizes["ep"]
        self.ep_comm = Communicator(self.groups["ep"], ep)
        self.ep_comm.reserve(dev, moe_layers, num_experts)
        self.recv = (torch.empty((recv_rows, width), dtype=act, device=dev),
                     torch.empty((recv_rows, top_k), dtype=torch.int64, device=dev),
                     torch.empty((recv_rows, top_k), dtype=torch.float32, device=dev))
        self.counts = (torch.zeros(ep, dtype=torch.int64, device=dev), torch.zeros(ep, dtype=torch.int64, device=dev))

    def begin_step(self, valid: int, block_rows: int) -> None:
        """Device transport, before a step (or its graph's replay): the real tokens of this rank's dispatch input
        (from its first row; 0 idle) and the transport (`block_rows` B > 0: blocks, the same on every rank)."""
        self.ep_comm.begin_step(valid, block_rows)

    def run(self, step: Step, num_experts: int, counts: list) -> object:
        """Run this rank's step, answering its requests over torch.distributed."""
        result = None
        try:
            while True:
                result = self.answer(step.send(result), num_experts, counts)
        except StopIteration as stop:
            return stop.value

    def answer(self, req: Request, num_experts: int, counts: list) -> object:
        group, size = self.groups[req.group], self.sizes[req.group]
        if isinstance(req, AllReduce):
            y = req.x.contiguous().clone()
            self.dist.all_reduce(y, group=group)
            return y
        if isinstance(req, AllGather):
            x = req.x.contiguous()
            parts = [torch.empty_like(x) for _ in range(size)]
            self.dist.all_gather(parts, x, group=group)
            return torch.cat(parts, dim=req.axis)
        if isinstance(req, Dispatch):
            if self.ep_comm is not None:
                return self.device_dispatch(req, num_experts)
            return self.dispatch(req, size, num_experts, counts)
        if isinstance(req.layout, DeviceLayout):
            out = torch.empty((req.num_tokens, req.partial.shape[1]), dtype=req.partial.dtype, device=self.device)
            lay = req.layout
            self.ep_comm.moe_combine(req.partial, lay.send_rows, lay.send_counts, lay.recv_counts, out)
            return out
        back = self._exchange(req.partial, req.layout.recv_counts.tolist(), req.layout.send_counts.tolist(), group)
        return _combine_rows(req.num_tokens, back, req.layout.send_rows)

    def device_dispatch(self, req: Dispatch, num_experts: int) -> tuple:
        """The device transport's dispatch into the receive buffers (rows past the received head are stale)."""
        send_rows = torch.empty(req.ids.numel(), dtype=torch.int64, device=self.device)
        self.ep_comm.moe_dispatch(req.x.contiguous(), req.ids.contiguous(), req.weights.float().contiguous(),
                                  num_experts, (*self.recv, send_rows, *self.counts))
        return (*self.recv, DeviceLayout(send_rows, *self.counts, self.ep_comm.recv_bound))

    def dispatch(self, req: Dispatch, ep: int, num_experts: int, counts: list) -> tuple:
        ids = req.ids.cpu().numpy()
        counts.append(np.bincount(ids.ravel(), minlength=num_experts))
        rows, send_counts = send_plan(ids, num_experts, ep)
        recv_counts = torch.empty(ep, dtype=torch.int64, device=self.device)
        self.dist.all_to_all_single(recv_counts, torch.from_numpy(send_counts).to(self.device), group=self.groups["ep"])
        recv = recv_counts.cpu().numpy()
        sends, recvs, picked = send_counts.tolist(), recv.tolist(), torch.from_numpy(rows).to(req.x.device)
        group = self.groups["ep"]
        recv_x = self._exchange(req.x[picked], sends, recvs, group)
        recv_ids = self._exchange(req.ids[picked].to(getattr(torch, np.dtype(ID_WIRE_DTYPE).name)), sends, recvs, group)
        recv_w = self._exchange(req.weights[picked].float(), sends, recvs, group)
        return recv_x, recv_ids.long(), recv_w, DispatchLayout(rows, send_counts, recv)

    def _exchange(self, send: torch.Tensor, sends: list[int], recvs: list[int], group) -> torch.Tensor:
        """Rows grouped by destination (`sends` each) exchanged; rows from each source in rank order."""
        out = torch.empty((sum(recvs), *send.shape[1:]), dtype=send.dtype, device=send.device)
        self.dist.all_to_all_single(out, send.contiguous(), recvs, sends, group=group)
        return out

"""MoE all-to-all dispatch and combine (the `dp` layout): routing bookkeeping, a reference over a whole
world in one process, and the MPI implementation the CPU runtime runs between ONNX Runtime segments.

Dispatch, on each rank of the ep group (this rank's tokens x [T, D], their top-k global expert ids [T, K]
and routing weights [T, K]; expert e lives on rank e // (E / ep)):
  1. route locally: each token goes once to each distinct rank among its K experts' ranks; the rows to send
     are ordered by destination rank, then token index: `send_rows` [S] (token index of each sent row),
     `send_counts` [ep] (rows per destination; a rank's own tokens count too, they are not sent anywhere);
  2. the token counts per destination are exchanged first (an all-to-all of ep integers), so every rank
     knows `recv_counts` [ep] and sizes its receive buffers exactly: no padding;
  3. the rows, their ids and weights are exchanged (all-to-all-v): recv_x [R, D], recv_ids [R, K],
     recv_w [R, K], grouped by source rank in rank order. Ids stay global: the expert op (`MoEMXFP4` with this
     rank's `expert_offset`) adds only this rank's experts, weighted by the routing weights.
Combine (the weighted partial sums y [R, D], rows in recv order):
  4. each row goes back to its source (all-to-all-v with the counts swapped);
  5. each source adds the S rows it gets into out [T, D] at `send_rows`, in destination-rank order: the order
     in which the all-reduce of the `tp` layout sums the ranks' partials, so both layouts add the same terms.

An idle rank (its group has nothing to run) joins with T = 0: it sends nothing and still computes and
returns what the others send it, so no rank waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ID_WIRE_DTYPE = np.int32  # expert ids travel as int32 (E < 2^31), weights as fp32
KIND = "moe_all_to_all"  # `Traffic` key of both ops


@dataclass
class DispatchLayout:
    """Where this rank's rows went: send_rows [S] int64 (token index per sent row, by destination rank),
    send_counts [ep] int64, recv_counts [ep] int64 (rows received from each source rank)."""

    send_rows: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks, by collective (what the network carries; rows a rank keeps for its
    own experts are not counted), and the MoE tokens routed (rows of x dispatched or all-reduced)."""

    sent_bytes: dict[str, int] = field(default_factory=dict)
    moe_tokens: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.sent_bytes[kind] = self.sent_bytes.get(kind, 0) + int(nbytes)


def expert_rank(ids: np.ndarray, num_experts: int, ep: int) -> np.ndarray:
    """Rank of the ep group holding each global expert id (contiguous slices of E / ep experts)."""
    return ids // (num_experts // ep)


def send_plan(ids: np.ndarray, num_experts: int, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """(send_rows [S], send_counts [ep]) for top-k ids [T, K]: each token once per distinct destination rank,
    rows ordered by destination rank then token."""
    num_tokens = ids.shape[0]
    goes = np.zeros((ep, num_tokens), dtype=bool)
    if num_tokens:
        goes[expert_rank(ids, num_experts, ep), np.arange(num_tokens)[:, None]] = True
    dest, rows = np.nonzero(goes)  # row-major: by destination, then token
    return rows.astype(np.int64), np.bincount(dest, minlength=ep).astype(np.int64)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def wire_bytes(rank: int, send_counts: np.ndarray, row_bytes: int) -> int:
    """Bytes of `send_counts` rows of `row_bytes` each that leave `rank` (its own rows stay)."""
    return int((send_counts.sum() - send_counts[rank]) * row_bytes)


def dispatch_row_bytes(x: np.ndarray, top_k: int) -> int:
    """Bytes one dispatched row carries: its activations, top-k ids (int32) and weights (fp32)."""
    return x.shape[1] * x.dtype.itemsize + top_k * (np.dtype(ID_WIRE_DTYPE).itemsize + 4)


# ---- reference: a whole ep group in one process ---------------------------------------------------------


def reference_dispatch(xs: list[np.ndarray], ids: list[np.ndarray], weights: list[np.ndarray], num_experts: int,
                       traffic: list[Traffic] | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, DispatchLayout]]:
    """Dispatch of every rank of an ep group at once: per rank (recv_x, recv_ids, recv_w, layout)."""
    ep = len(xs)
    plans = [send_plan(i, num_experts, ep) for i in ids]
    out = []
    for dst in range(ep):
        parts_x, parts_i, parts_w = [], [], []
        for src, (rows, counts) in enumerate(plans):
            start = int(counts[:dst].sum())
            sel = rows[start: start + int(counts[dst])]
            parts_x.append(xs[src][sel])
            parts_i.append(ids[src][sel])
            parts_w.append(weights[src][sel])
        recv_counts = np.array([int(plans[src][1][dst]) for src in range(ep)], dtype=np.int64)
        layout = DispatchLayout(plans[dst][0], plans[dst][1], recv_counts)
        out.append((np.concatenate(parts_x), np.concatenate(parts_i), np.concatenate(parts_w), layout))
    if traffic is not None:
        for src, (x, i) in enumerate(zip(xs, ids)):
            traffic[src].add(KIND, wire_bytes(src, plans[src][1], dispatch_row_bytes(x, i.shape[1]))
                             + (ep - 1) * plans[src][1].itemsize)  # the counts go first
            traffic[src].moe_tokens += x.shape[0]
    return out


def reference_combine(ys: list[np.ndarray], layouts: list[DispatchLayout], num_tokens: list[int],
                      traffic: list[Traffic] | None = None) -> list[np.ndarray]:
    """Combine of every rank at once: ys[r] [R_r, D] in rank r's recv order -> out[r] [T_r, D]."""
    ep = len(ys)
    out = []
    for src in range(ep):
        lay = layouts[src]
        back = []
        for dst in range(ep):  # the rows rank dst received from src, in the order src sent them
            start = int(layouts[dst].recv_counts[:src].sum())
            back.append(ys[dst][start: start + int(layouts[dst].recv_counts[src])])
        total = np.zeros((num_tokens[src], ys[src].shape[1]), dtype=ys[src].dtype)
        np.add.at(total, lay.send_rows, np.concatenate(back))
        out.append(total)
    if traffic is not None:
        for dst, y in enumerate(ys):
            traffic[dst].add(KIND, wire_bytes(dst, layouts[dst].recv_counts, y.shape[1] * y.dtype.itemsize))
    return out


# ---- MPI (one rank per process) -------------------------------------------------------------------------


def _alltoallv(comm, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
    """Rows of `send` (grouped by destination, `send_counts` rows each) exchanged; rows from each source in
    rank order ([sum(recv_counts), ...])."""
    from mpi4py.util.dtlib import from_numpy_dtype

    send = np.ascontiguousarray(send)
    row = int(np.prod(send.shape[1:], dtype=np.int64))
    recv = np.empty((int(recv_counts.sum()), *send.shape[1:]), dtype=send.dtype)
    mpi_type = from_numpy_dtype(send.dtype)
    sc, rc = send_counts * row, recv_counts * row
    comm.Alltoallv([send, (sc, _offsets(sc)), mpi_type], [recv, (rc, _offsets(rc)), mpi_type])
    return recv


def mpi_dispatch(comm, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, num_experts: int,
                 traffic: Traffic | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, DispatchLayout]:
    """This rank's dispatch over `comm` (the ep group): counts first, then rows, ids and weights."""
    ep, rank = comm.Get_size(), comm.Get_rank()
    rows, send_counts = send_plan(ids, num_experts, ep)
    recv_counts = np.empty(ep, dtype=np.int64)
    comm.Alltoall(send_counts, recv_counts)
    recv_x = _alltoallv(comm, x[rows], send_counts, recv_counts)
    recv_ids = _alltoallv(comm, ids[rows].astype(ID_WIRE_DTYPE), send_counts, recv_counts).astype(np.int64)
    recv_w = _alltoallv(comm, weights[rows].astype(np.float32), send_counts, recv_counts)
    if traffic is not None:
        traffic.add(KIND, wire_bytes(rank, send_counts, dispatch_row_bytes(x, ids.shape[1]))
                    + (ep - 1) * send_counts.itemsize)  # the counts go first
        traffic.moe_tokens += x.shape[0]
    return recv_x, recv_ids, recv_w, DispatchLayout(rows, send_counts, recv_counts)


def mpi_combine(comm, y: np.ndarray, layout: DispatchLayout, num_tokens: int,
                traffic: Traffic | None = None) -> np.ndarray:
    """This rank's combine over `comm`: partial sums back to their sources, added at `send_rows`."""
    back = _alltoallv(comm, y, layout.recv_counts, layout.send_counts)
    out = np.zeros((num_tokens, y.shape[1]), dtype=y.dtype)
    np.add.at(out, layout.send_rows, back)
    if traffic is not None:
        traffic.add(KIND, wire_bytes(comm.Get_rank(), layout.recv_counts, y.shape[1] * y.dtype.itemsize))
    return out


def all_reduce_ring_bytes(nbytes: int, group_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes` over `group_size` ranks (NCCL's ring):
    2 (n - 1) / n of the payload."""
    return 0 if group_size == 1 else 2 * (group_size - 1) * nbytes // group_size


# ---- torch.distributed into static buffers (the TensorRT path's NCCL `nccl.Communicator`; gloo on CPU) ------------
#
# A TensorRT plugin's outputs have shapes fixed from its inputs' shapes and its fields, so the receive buffers are
# sized for the worst case (`max_recv_rows` = ep * ceil(max_num_tokens / tp): each source routes at most its share
# of its group's tokens and sends each at most once to a rank) while only counted rows move and compute. Both
# transports below fill the same buffers the same way: the R rows received sit at the HEAD of recv_x / recv_ids /
# recv_w (source 0's, then source 1's, ...), R = sum(recv_counts) on the device; rows past R are neither written
# nor read (the expert op bounds itself by recv_counts on the device). A row travels packed: its activations, its
# K int32 expert ids and K fp32 weights in one byte row, so rows, ids and weights are one exchange.
#   - counted (`block_rows` 0; eager steps): the counts all-to-all, ONE read-back of the counts (NCCL's
#     all-to-all-v takes host split sizes), then the rows with exact split sizes: no padding on the wire.
#   - blocks (`block_rows` B > 0; decode steps, which CUDA graphs replay): every rank sends every peer a block of
#     B packed rows, the first send_counts[d] of which carry tokens, with equal split sizes, so no host value is
#     needed; the received blocks are compacted to the head on the device. B must be the same on every rank and
#     at least any rank's tokens: the runners agree on it per world step (ceil(bucket / tp) of the world's decode
#     bucket). Costs the blocks' padding on the wire: at most ep / min(K, ep) times the counted rows.
# `send_rows` [T * K] int64 tells the combine where each (token, choice)'s partial sum comes back: the row of the
# returned rows (as sent: by destination, then token) for the token's first choice on each destination rank, -1 for
# the other choices and for tokens past `valid`; the combine sums a token's rows over its K choices (deterministic).
# The per-expert token counts stay on the device (`routed`), read with the step's one wait.
# The device work is five Triton kernels (`transport_kernels`): routing, packing into the send buffer (the rows of
# a block past its tokens are sent unwritten, never read) and unpacking to the head in the dispatch; the blocks'
# expansion from the head and each token's sum in the combine. NCCL does the rest: 2 all-to-alls in the dispatch
# (counts, packed rows), 1 in the combine.

_ROW_ALIGN = 16  # bytes a packed row is padded to


def packed_row_bytes(dim: int, act_bytes: int, top_k: int) -> int:
    """Bytes of one packed dispatch row: activations, int32 ids and fp32 weights, padded to 16."""
    return -(-(dim * act_bytes + 8 * top_k) // _ROW_ALIGN) * _ROW_ALIGN


def torch_dispatch_into(group, ep: int, x, ids, weights, num_experts: int, outputs, *, valid, routed,
                        block_rows: int = 0):  # fmt: skip
    """MoEDispatch over a torch.distributed group into static buffers `outputs` = (recv_x [R_max, D],
    recv_ids [R_max, K] int64, recv_w [R_max, K] fp32, send_rows [T * K] int64, send_counts [ep] int64,
    recv_counts [ep] int64), the tokens at or past `valid` ([1] int64 on the device; 0 for an idle group) sending
    nothing. `block_rows` 0: the counted transport (returns the host counts (sends, recvs) the combine needs, from
    the step's one read-back); B > 0: blocks of B rows per peer (returns None: no host value). The tokens routed
    to each expert are written into `routed` [E] int64 (device)."""
    import torch
    import torch.distributed as dist

    from . import transport_kernels as kernels

    recv_x, recv_ids, recv_w, send_rows, send_counts, recv_counts = outputs
    if block_rows:
        if ep * block_rows > recv_x.shape[0]:
            raise RuntimeError(f"MoEDispatch: blocks of {block_rows} rows from {ep} ranks exceed the receive bound "
                               f"{recv_x.shape[0]} (max_recv_rows)")
        if x.shape[0] > block_rows:
            raise RuntimeError(f"MoEDispatch: {x.shape[0]} tokens do not fit blocks of {block_rows} rows")
    kernels.route(ids, valid, num_experts, ep, block_rows, send_counts, send_rows, routed)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    width = packed_row_bytes(x.shape[1], x.element_size(), ids.shape[1])
    if block_rows:
        counts, sent, received = None, ep * block_rows, ep * block_rows
    else:
        host = torch.cat([send_counts, recv_counts]).tolist()  # the one read-back of the counted transport
        counts = (host[:ep], host[ep:])
        sent, received = sum(counts[0]), sum(counts[1])
        if received > recv_x.shape[0]:
            raise RuntimeError(f"MoEDispatch: {received} rows received, the engine's bound is "
                               f"{recv_x.shape[0]} (max_recv_rows = ep x ceil(max_num_tokens / tp))")
    send = torch.empty((sent, width), dtype=torch.uint8, device=x.device)
    kernels.pack(x, ids, weights, send_rows, send)
    stage = torch.empty((received, width), dtype=torch.uint8, device=x.device)
    if block_rows:
        dist.all_to_all_single(stage, send, group=group)
    else:
        dist.all_to_all_single(stage, send, counts[1], counts[0], group=group)
    kernels.unpack(stage, recv_x, recv_ids, recv_w, recv_counts, block_rows)
    return counts


def torch_combine_into(group, partial, send_rows, recv_counts, out, *, counts=None, block_rows: int = 0) -> None:
    """MoECombine over a torch.distributed group: the received rows' partial sums (the head of `partial`
    [R_max, D]) back to their sources, where each token's rows are summed over its choices (`send_rows` [T * K])
    into `out` [T, D]. `block_rows` B > 0: blocks of B rows per peer; else the counted transport with the host
    `counts` (sends, recvs) of the matching dispatch."""
    import torch
    import torch.distributed as dist

    from . import transport_kernels as kernels

    if block_rows:
        rows = recv_counts.shape[0] * block_rows
        blocks = torch.empty((rows, partial.shape[1]), dtype=partial.dtype, device=partial.device)
        kernels.expand(partial, recv_counts, block_rows, blocks)
        back = torch.empty_like(blocks)
        dist.all_to_all_single(back, blocks, group=group)
    else:
        sends, recvs = counts
        back = torch.empty((sum(sends), partial.shape[1]), dtype=partial.dtype, device=partial.device)
        dist.all_to_all_single(back, partial[: sum(recvs)], sends, recvs, group=group)
    kernels.sum_returned(back, send_rows, out)

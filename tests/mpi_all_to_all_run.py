"""Run under `mpiexec -n EP`: every rank makes every rank's tokens (seeded; rank 1 idle), runs MoEDispatch ->
its experts -> MoECombine with MPI (`all_to_all.mpi_*`) and with torch.distributed over gloo through the TensorRT
plugins' enqueue: the QDP impls of `plugins/collectives/tensorrt_plugin.py` under TensorRT's real pure-Python
`tensorrt.plugin` (over `tensorrt_standin.py`'s core), called as TensorRT calls them with the static output
buffers TensorRT would hand them (filled with garbage), and the `nccl.Communicator` they take by group name, in
both transports (counted, and fixed blocks). What is not TensorRT here: buffers are CPU tensors (`as_torch` maps a
handle to one; TensorRT's are CUDA views), the stream is not entered, and the transport's Triton kernels run in
Triton's interpreter (run with TRITON_INTERPRET=1, as tests/test_wide_ep.py does). The idle rank runs a dummy token with no
real token, as the TensorRT runner's idle step does; the others carry two padding tokens past their real ones, as
a padded decode step does. Everything is compared with the in-process reference. Rank 0 prints one JSON line
{"mpi_max_err", "rows_received" [per rank], "mpi_shapes_match", "plugin_err_bound", "counted" / "blocks":
{"plugin_max_err", "shapes_match", "rows_ok", "counts_ok"}}."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from moe_export.plugins.collectives import all_to_all, nccl

sys.path.insert(0, str(Path(__file__).parent))
import tensorrt_standin  # noqa: E402
from fp32_reorder import U32  # noqa: E402

EXPERTS, TOP_K, DIM = 8, 3, 6


def tokens(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    n = 0 if rank == 1 else 2 + 3 * rank
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)]) if n else np.zeros((0, TOP_K), np.int64)
    return rng.standard_normal((n, DIM)).astype(np.float32), ids.astype(np.int64), rng.random((n, TOP_K)).astype(np.float32)


def experts(x: np.ndarray, ids: np.ndarray, w: np.ndarray, rank: int, ep: int) -> np.ndarray:
    """This rank's experts: expert e scales by (e + 1) and adds e; weighted sum over the rank's choices."""
    per = EXPERTS // ep
    y = np.zeros_like(x)
    for j in range(ids.shape[1]):
        on = (ids[:, j] // per == rank)[:, None]
        y += np.where(on, w[:, j:j + 1] * (x * (ids[:, j:j + 1] + 1) + ids[:, j:j + 1]), 0.0).astype(np.float32)
    return y


def main() -> None:
    world = MPI.COMM_WORLD
    rank, ep = world.Get_rank(), world.Get_size()
    data = [tokens(r) for r in range(ep)]
    recv = all_to_all.reference_dispatch(*zip(*data), EXPERTS)
    ys = [experts(rx, ri, rw, r, ep) for r, (rx, ri, rw, _) in enumerate(recv)]
    want = all_to_all.reference_combine(ys, [lay for *_, lay in recv], [d[0].shape[0] for d in data])[rank]

    rx, ri, rw, lay = all_to_all.mpi_dispatch(world, *data[rank], EXPERTS)
    mpi_out = all_to_all.mpi_combine(world, experts(rx, ri, rw, rank, ep), lay, data[rank][0].shape[0])

    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep)
    comm = nccl.Communicator(dist.new_group(list(range(ep))), ep)
    nccl.set_communicators({"ep": comm})
    _, trtp = tensorrt_standin.install("11.4")
    from moe_export.plugins.collectives import tensorrt_plugin

    qdp = sys.modules["tensorrt.plugin._lib"].QDP_REGISTRY
    buffers: dict[int, torch.Tensor] = {}

    def handle(t: torch.Tensor):
        h = trtp.Tensor()
        h.data_ptr = t.data_ptr()
        buffers[h.data_ptr] = t
        return h

    tensorrt_plugin.as_torch = lambda h: buffers[h.data_ptr]
    torch.cuda.ExternalStream = lambda stream: None  # torch.cuda.stream(None) enters nothing

    max_tokens = max(d[0].shape[0] for d in data)
    bound = ep * (max_tokens + 2) + 5  # Mapping.max_recv_rows at tp 1 (padded shares), and a few rows more
    comm.reserve(torch.device("cpu"), 1, EXPERTS)
    x, ids, w = (torch.from_numpy(a) for a in data[rank])
    idle = rank == 1
    if idle:  # TensorRT's profile starts at one token: the idle step carries a dummy one, none of it real
        x, ids, w = torch.ones(1, DIM), torch.tensor([[0, 3, 5]]), torch.ones(1, TOP_K)
    else:  # a decode-graph step pads its share: two padding tokens past the real ones, routed but never sent
        pad_ids = torch.tensor([[1, 2, 7], [4, 5, 6]])
        x, ids, w = torch.cat([x, torch.ones(2, DIM)]), torch.cat([ids, pad_ids]), torch.cat([w, torch.ones(2, TOP_K)])
    results = {}
    for transport, block in (("counted", 0), ("blocks", max_tokens + 2)):
        comm.begin_step(0 if idle else data[rank][0].shape[0], block)
        results[transport] = run_plugins(comm, qdp, tensorrt_plugin, handle, x, ids, w, bound, ep, rank, block > 0)
    dist.destroy_process_group()
    real = data[rank][0].shape[0]
    want_routed = np.bincount(data[rank][1].ravel(), minlength=EXPERTS).tolist()
    row = [max_err(mpi_out, want), int(rx.shape[0]), mpi_out.shape == want.shape, combine_err_bound(*data[rank])]
    for y, copied_ok, got, sent, send_counts, routed, rows_ok in results.values():
        plugin_out = y.numpy()[:real]
        row += [max_err(plugin_out, want), plugin_out.shape == want.shape and got == int(rx.shape[0]),
                rows_ok and (not idle or (sent == 0 and not y.any())),
                routed == want_routed and send_counts == lay.send_counts.tolist() and copied_ok]
    errs = world.gather(row, root=0)
    if rank == 0:
        out = {"mpi_max_err": max(e[0] for e in errs), "rows_received": [e[1] for e in errs],
               "mpi_shapes_match": all(e[2] for e in errs), "plugin_err_bound": max(e[3] for e in errs)}
        for i, transport in enumerate(results):
            at = 4 + 4 * i
            out[transport] = {"plugin_max_err": max(e[at] for e in errs), "shapes_match": all(e[at + 1] for e in errs),
                              "rows_ok": all(e[at + 2] for e in errs), "counts_ok": all(e[at + 3] for e in errs)}
        print(json.dumps(out))


def combine_err_bound(x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> float:
    """|plugin - reference| bound for this rank's combined rows: each is a float32 sum of at most TOP_K partial
    rows (one per expert choice) that the plugin's sum kernel may add in another order than the reference's
    np.add.at, which moves it by at most 2 (TOP_K - 1) u sum|terms| (Higham 4.2; 2: both sums round)."""
    terms = np.abs(w[:, :, None].astype(np.float64) * (x[:, None, :] * (ids[:, :, None] + 1) + ids[:, :, None]))
    return 2 * (TOP_K - 1) * U32 * float(terms.sum(axis=1).max(initial=0.0))


def max_err(got: np.ndarray, want: np.ndarray) -> float:
    """Max abs error, inf where `got` is NaN (a NaN would drop out of the max over ranks)."""
    return float(np.nan_to_num(np.abs(got - want), nan=np.inf).max(initial=0.0)) if got.shape == want.shape else np.inf


@contextlib.contextmanager
def no_host_reads(on: bool):
    """While `on`: a tensor's value read by the host (`tolist`, `item`, `bool`, `int`, `numpy`, `cpu`) raises, as
    it would synchronize with a GPU (the block transport must not: CUDA graphs capture it). The script's own
    checks run outside."""
    names = ("tolist", "item", "__bool__", "__int__", "numpy", "cpu")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"host read of a tensor ({name}) in the block transport")
        return read

    if on:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def run_plugins(comm, qdp, tensorrt_plugin, handle, x, ids, w, bound, ep, rank, no_reads):
    """Dispatch -> this rank's experts on the received head rows -> combine, through the QDP impls, into
    garbage-filled static buffers; the combine runs twice, once handed copies of the count buffers. `no_reads`:
    the impls run under `no_host_reads`."""
    outs = (torch.full((bound, DIM), float("nan")), torch.full((bound, TOP_K), 12345, dtype=torch.int64),
            torch.full((bound, TOP_K), 7.0), torch.full((x.shape[0] * TOP_K,), 99, dtype=torch.int64),
            torch.full((ep,), 99, dtype=torch.int64), torch.full((ep,), 99, dtype=torch.int64))
    fields = ("ep\0", np.array([EXPERTS], np.int32), np.array([ep], np.int32), np.array([bound], np.int32))
    with no_host_reads(no_reads):
        qdp[tensorrt_plugin.MOE_DISPATCH].impl_func(handle(x), handle(ids), handle(w), handle(x), *fields,
                                                     [handle(o) for o in outs], stream=7)
    recv_x, recv_ids, recv_w, send_rows, send_counts, recv_counts = outs
    got = int(recv_counts.sum())
    bound_ok = comm.recv_bound is not None and got <= comm.recv_bound <= bound - 5
    partial = torch.full((bound, DIM), float("nan"))
    partial[:got] = torch.from_numpy(experts(recv_x[:got].numpy(), recv_ids[:got].numpy(), recv_w[:got].numpy(), rank, ep))
    combine = qdp[tensorrt_plugin.MOE_COMBINE].impl_func
    copied, y = torch.full(x.shape, float("nan")), torch.full(x.shape, float("nan"))
    with no_host_reads(no_reads):
        combine(handle(partial), handle(send_rows), handle(send_counts.clone()), handle(recv_counts.clone()),
                handle(x), handle(x), "ep\0", [handle(copied)], stream=7)  # `after` (never read): any tensor
        combine(handle(partial), handle(send_rows), handle(send_counts), handle(recv_counts), handle(x), handle(x),
                "ep\0", [handle(y)], stream=7)
    sent = int(send_counts.sum())
    rows_ok = (bound_ok and comm.recv_bound is None and bool(torch.isnan(recv_x[-1]).all())
               and bool((send_rows >= -1).all()) and int((send_rows >= 0).sum()) == sent)
    return y, torch.equal(copied, y), got, sent, send_counts.tolist(), comm.routed[0].tolist(), rows_ok


if __name__ == "__main__":
    main()

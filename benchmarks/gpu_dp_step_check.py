"""The dp layout's MoE layer as a TensorRT decode step runs it, on one GPU (a NCCL world of one: ep = 1), as JSON.

The layer is what the engine's three plugins call: `Communicator.moe_dispatch` -> `moe_mxfp4_triton` on the
received head rows (their count read on the device, chunks bounded by `recv_bound`) -> `Communicator.moe_combine`,
with static buffers as TensorRT hands them, `tokens` dispatch rows of which `real` carry tokens (a padded decode
bucket). Keys:
  - `dp_layer_no_host_sync`: the block transport's layer runs under `torch.cuda.set_sync_debug_mode("error")`
    (any host synchronization raises);
  - `dp_layer_graph_max_err`: the layer captured in a CUDA graph, replayed with another count of real tokens
    (set before the replay, as the runner does), equals its eager run; `dp_layer_vs_counted_max_err`: the block
    transport equals the counted one;
  - `dp_layer_graph_ms` (replay) and `dp_layer_eager_counted_ms` (the eager counted transport: one read-back of
    the counts), timed in interleaved rounds, and their ratio `dp_layer_graph_speedup`;
  - `dp_layer_transport_ops`: the device work of the block transport's dispatch and combine: the Triton kernels
    of `plugins/collectives/transport_kernels.py` launched (each launch recorded by a pass-through wrapper), the
    aten ops that launch work (views excluded) and the collectives, the last two counted with a
    TorchDispatchMode, on any device: what `export/plan/decode_model.py` (`TRANSPORT_OPS`) says a decode step's
    layer launches besides the expert op.
Shapes: K3's latent width 3,584, intermediate 3,072, top-16, over 32 local experts (one GPU holds every expert
at ep = 1). `--device cpu`: gloo, Triton's interpreter, tiny shapes, no graph and no sync guard
(`tests/test_dp_decode_model.py` runs it). Run from the repo root:
`python3 benchmarks/gpu_dp_step_check.py --json $OUT/gpu_dp_step_check.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import socket

import torch
import torch.distributed as dist
from moe_export.plugins.collectives import transport_kernels
from moe_export.plugins.collectives.nccl import Communicator
from moe_export.plugins.moe_mxfp4.sizes import workspace_bytes
from moe_export.plugins.moe_mxfp4.triton_kernel import moe_mxfp4_triton
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]
from gpu_trt_check import wall_ms
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

GPU_SHAPES = {"experts": 32, "top_k": 16, "dim": 3584, "inter": 3072, "tokens": 24, "real": 20, "replay_real": 13,
              "max_recv_rows": 1024}  # fmt: skip
CPU_SHAPES = {"experts": 4, "top_k": 2, "dim": 64, "inter": 32, "tokens": 6, "real": 5, "replay_real": 3,
              "max_recv_rows": 16}  # fmt: skip


def world_of_one(device: torch.device) -> Communicator:
    """torch.distributed over one rank (NCCL on a GPU, gloo on CPU) and its ep communicator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return Communicator(dist.new_group([0]), 1)


def inputs(device: torch.device, shapes: dict) -> dict:
    """Seeded tokens, routing and MXFP4 experts (scales near 1), and the static buffers of one layer."""
    e, k, d, i, t, rows = (shapes[n] for n in ("experts", "top_k", "dim", "inter", "tokens", "max_recv_rows"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16  # the expert op takes bf16 in and out (plugins/moe_mxfp4/triton_kernel.py)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    packed = [torch.randint(0, 256, s, generator=gen, dtype=torch.int32).to(torch.uint8)
              for s in ((e, 2 * i, d // 2), (e, 2 * i, d // 32), (e, d, i // 2), (e, d, i // 32))]  # fmt: skip
    for s in (packed[1], packed[3]):
        s.clamp_(118, 126)
    on = {"x": torch.randn(t, d, generator=gen).to(dtype), "ids": ids, "w": torch.rand(t, k, generator=gen) / k,
          "weights": packed, "workspace": torch.zeros(workspace_bytes(rows, k, d, i, e), dtype=torch.uint8),
          "outs": (torch.zeros(rows, d, dtype=dtype), torch.zeros(rows, k, dtype=torch.int64),
                   torch.zeros(rows, k), torch.zeros(t * k, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                   torch.zeros(1, dtype=torch.int64)),
          "partial": torch.zeros(rows, d, dtype=dtype), "y": torch.zeros(t, d, dtype=dtype)}  # fmt: skip
    return {n: (v.to(device) if isinstance(v, torch.Tensor) else [u.to(device) for u in v] if isinstance(v, list)
                else tuple(u.to(device) for u in v)) for n, v in on.items()}  # fmt: skip


def layer(comm: Communicator, b: dict, experts: int) -> None:
    """Dispatch -> expert op on the rows received -> combine, into b's static buffers."""
    comm.moe_dispatch(b["x"], b["ids"], b["w"], experts, b["outs"])
    recv_x, recv_ids, recv_w, send_rows, send_counts, recv_counts = b["outs"]
    moe_mxfp4_triton(recv_x, recv_ids, recv_w, *b["weights"], expert_offset=0, recv_counts=recv_counts,
                     row_bound=comm.recv_bound, out=b["partial"], workspace=b["workspace"])  # fmt: skip
    comm.moe_combine(b["partial"], send_rows, send_counts, recv_counts, b["y"])


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that launch device work (views and metadata ops excluded) and the c10d collectives;
    `kernels` collects the transport's Triton launches (`recording_kernels`)."""

    VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "expand", "unsqueeze", "squeeze", "reshape", "alias",
             "as_strided", "detach", "permute", "transpose", "split", "unbind", "empty", "lift_fresh", "_to_copy_view"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.ops, self.collectives, self.kernels = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d":
            self.collectives.append(name)
        elif name not in self.VIEWS and not name.startswith("empty"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class KernelLaunches:
    """A pass-through of one Triton kernel: each launch appended to `log`, then run as is, outside any
    TorchDispatchMode (Triton's interpreter copies its tensor arguments with torch ops: not the transport's)."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(self.name)
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def recording_kernels(log: list):
    """The transport's kernels (`transport_kernels.KERNELS`) wrapped in `KernelLaunches` for the duration."""
    saved = {name: getattr(transport_kernels, name) for name in transport_kernels.KERNELS}
    for name, kernel in saved.items():
        setattr(transport_kernels, name, KernelLaunches(kernel, name, log))
    try:
        yield
    finally:
        for name, kernel in saved.items():
            setattr(transport_kernels, name, kernel)


def transport_ops(comm: Communicator, b: dict, experts: int) -> dict:
    """The block transport's dispatch and combine of one layer, their kernels, ops and collectives counted (the
    expert op not run: the combine sends back whatever the partial sums hold)."""
    recv_x, recv_ids, recv_w, send_rows, send_counts, recv_counts = b["outs"]
    dispatch, combine = OpCounter(), OpCounter()
    with recording_kernels(dispatch.kernels), dispatch:
        comm.moe_dispatch(b["x"], b["ids"], b["w"], experts, b["outs"])
    with recording_kernels(combine.kernels), combine:
        comm.moe_combine(b["partial"], send_rows, send_counts, recv_counts, b["y"])
    return {"dispatch_kernels": len(dispatch.kernels), "dispatch_ops": len(dispatch.ops),
            "dispatch_collectives": len(dispatch.collectives), "combine_kernels": len(combine.kernels),
            "combine_ops": len(combine.ops), "combine_collectives": len(combine.collectives),
            "names": {"kernels": dispatch.kernels + combine.kernels, "ops": sorted(dispatch.ops + combine.ops)}}  # fmt: skip


def check(fig: Figures, device: torch.device, shapes: dict, repeats: int) -> None:
    """The stages of the module docstring, each recorded in `fig` (and written) as it ends."""
    fig["dp_layer_shapes"] = shapes
    with fig.stage("dp_layer_world"):
        comm = world_of_one(device)
        b = inputs(device, shapes)
        comm.reserve(device, 1, shapes["experts"])
    if "dp_layer_world_error" in fig:
        return
    try:
        experts, tokens, real = shapes["experts"], shapes["tokens"], shapes["real"]
        with fig.stage("dp_layer_eager"):
            comm.begin_step(real, 0)  # the counted transport (eager steps), also compiling the kernels
            layer(comm, b, experts)
            counted = b["y"].clone()
            comm.begin_step(real, tokens)  # blocks of `tokens` rows: a decode bucket of `tokens` at tp 1
            guard = torch.cuda.set_sync_debug_mode if device.type == "cuda" else (lambda mode: None)
            guard("error")
            try:
                layer(comm, b, experts)
                fig["dp_layer_no_host_sync"] = True
            except RuntimeError as err:
                fig.update(dp_layer_no_host_sync=False, dp_layer_sync_error=str(err)[:300])
            finally:
                guard("default")
            fig["dp_layer_vs_counted_max_err"] = float((b["y"] - counted).abs().max())
            comm.begin_step(real, tokens)
            fig["dp_layer_transport_ops"] = transport_ops(comm, b, experts)
            fig["dp_layer_padding_rows_zero"] = bool((b["y"][real:] == 0).all())
        if device.type == "cuda":
            with fig.stage("dp_layer_graph"):
                graph_figures(fig, comm, b, shapes, repeats, device)
    finally:
        dist.destroy_process_group()


def graph_figures(fig: Figures, comm: Communicator, b: dict, shapes: dict, repeats: int, device) -> None:
    """The layer captured in a CUDA graph, replayed with another count of real tokens, against its eager run; then
    the replay and the eager counted transport timed in interleaved rounds."""
    experts, tokens, real = shapes["experts"], shapes["tokens"], shapes["real"]
    graph = torch.cuda.CUDAGraph()
    comm.begin_step(real, tokens)
    with torch.cuda.graph(graph):
        layer(comm, b, experts)
    comm.begin_step(shapes["replay_real"], tokens)  # as the runner sets the step before a replay
    graph.replay()
    replayed = b["y"].clone()
    comm.begin_step(shapes["replay_real"], tokens)
    layer(comm, b, experts)
    fig["dp_layer_graph_max_err"] = float((replayed - b["y"]).abs().max())

    def eager_counted():
        comm.begin_step(real, 0)
        layer(comm, b, experts)

    def replay():
        comm.begin_step(real, tokens)
        graph.replay()

    rounds = {"graph": [], "counted": []}
    for _ in range(5):  # interleaved rounds
        rounds["graph"].append(wall_ms(replay, device, repeats))
        rounds["counted"].append(wall_ms(eager_counted, device, repeats))
    fig["dp_layer_graph_ms"] = min(rounds["graph"])
    fig["dp_layer_eager_counted_ms"] = min(rounds["counted"])
    fig["dp_layer_graph_speedup"] = fig["dp_layer_eager_counted_ms"] / fig["dp_layer_graph_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run at tiny shapes")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    fig = Figures(args.json)  # written after every stage
    with fig.stage("dp_layer_device"):
        fig["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        if device.type == "cuda":
            torch.cuda.set_device(device)
    check(fig, device, GPU_SHAPES if device.type == "cuda" else CPU_SHAPES, args.repeats)


if __name__ == "__main__":
    main()

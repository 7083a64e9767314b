"""The communicators behind the in-engine collective plugins (plugins/collectives/nccl.py), run on CPU with
torch.distributed's gloo backend in two processes (NCCL needs GPUs; the calls are the same), and the
build-time switch."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_export.plugins.collectives import nccl


def test_concat_gathered_matches_torch_cat():
    parts = [torch.randn(3, 4, 5) + i for i in range(2)]
    stacked = torch.stack(parts)
    for axis in (0, 1, -1, 2):
        assert torch.equal(nccl.concat_gathered(stacked, axis), torch.cat(parts, dim=axis))


def test_building_switch_nests_and_restores():
    assert not nccl.is_building()
    with nccl.building():
        with nccl.building():
            assert nccl.is_building()
        assert nccl.is_building()
    assert not nccl.is_building()
    with pytest.raises(ValueError), nccl.building():
        raise ValueError
    assert not nccl.is_building()


def _worker(rank: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = nccl.Communicator(dist.new_group([0, 1]), 2)
    nccl.set_communicators({"tp": comm})
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    out = torch.empty(2, 3)
    nccl.communicator("tp").all_reduce(x, out)
    gathered = torch.empty(2, 6)
    comm.all_gather(x, gathered, -1)
    rows = torch.empty(4, 3)
    comm.all_gather(x, rows, 0)
    queue.put((rank, out.tolist(), gathered.tolist(), rows.tolist()))  # plain lists: outlive the process
    dist.destroy_process_group()


def test_all_reduce_and_all_gather_over_two_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    parts = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r for r in range(2)]
    for out, gathered, rows in results.values():
        assert out == (parts[0] + parts[1]).tolist()
        assert gathered == torch.cat(parts, dim=-1).tolist()
        assert rows == torch.cat(parts, dim=0).tolist()

"""The TensorRT runner's NCCL settings (issue 35): NVLink SHARP off (its buffers are not in `plan`), graph mixing
on (eager steps and CUDA-graph replays share the communicators), and a collective timeout that outlasts the first
step's JIT compilation between collectives; passed through `common.mpi.torch_group_comms`, the one rendezvous."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from moe_export.common import mpi
from moe_export.graphs.sharding import Mapping
from moe_export.runtime.engine import ranks, tensorrt_nccl

TORCH_NCCL_DEFAULT_TIMEOUT_S = 10 * 60  # torch.distributed's default for NCCL process groups


def test_engine_communicators_turn_nvls_off_keep_graph_mixing_and_outwait_the_warm_up(monkeypatch):
    seen = {}
    monkeypatch.setattr(tensorrt_nccl.os, "environ", {"NCCL_DEBUG": "WARN"})
    monkeypatch.setattr(ranks.MPICommunicator, "__init__", lambda self, mapping: None)

    def groups(mapping, backend, timeout_s=None):
        seen.update(backend=backend, timeout_s=timeout_s, env=dict(tensorrt_nccl.os.environ))
        return {}

    monkeypatch.setattr(tensorrt_nccl, "torch_group_comms", groups)
    tensorrt_nccl.NcclGroups(Mapping(2, 0, 2, 2))
    assert seen["env"] == {"NCCL_DEBUG": "WARN", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_MIXING_SUPPORT": "1"}
    assert seen["backend"] == "nccl" and seen["timeout_s"] > TORCH_NCCL_DEFAULT_TIMEOUT_S
    monkeypatch.setattr(tensorrt_nccl.os, "environ", {"NCCL_NVLS_ENABLE": "1"})  # an explicit setting wins
    tensorrt_nccl.NcclGroups(Mapping(2, 0, 2, 2))
    assert seen["env"]["NCCL_NVLS_ENABLE"] == "1"


def test_torch_group_comms_passes_the_timeout_to_the_process_group(monkeypatch):
    """The timeout reaches init_process_group; the rendezvous itself is stubbed (no connection is made: this test
    opens no socket) and tested in tests/test_rendezvous.py."""
    calls = []
    store = object()
    monkeypatch.setattr(mpi, "rendezvous_store", lambda mapping, backend: store)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(dist, "new_group", lambda ranks: tuple(ranks))
    mpi.torch_group_comms(Mapping(2, 0, 2, 2), "gloo", timeout_s=1800)
    mpi.torch_group_comms(Mapping(2, 0, 2, 2), "gloo")
    assert calls[0]["timeout"] == datetime.timedelta(seconds=1800) and calls[1]["timeout"] is None
    assert calls[0]["store"] is store

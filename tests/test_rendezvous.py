"""The torch.distributed rendezvous (`common.mpi.torch_group_comms`, used by the torch and TensorRT runners) forms a
group of ranks on two "nodes": under plain `mpiexec` (no MASTER_ADDR), each rank in its own network namespace with
its own hostname, joined by a veth pair (namespace addresses only; loopback of one is not the other's). Needs root
(`ip netns`); skipped where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NET = "10.251.7"  # a /24 that exists only on the veth pair inside the two namespaces


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Two network namespaces (names, addresses) joined by a veth pair; removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need `ip` and root")
    names = [f"mxrdv{os.getpid()}{c}" for c in "ab"]
    made = []
    try:
        for n in names:
            sh("ip", "netns", "add", n)
            made.append(n)
        sh("ip", "link", "add", names[0] + "v", "type", "veth", "peer", "name", names[1] + "v")
        for i, n in enumerate(names):
            sh("ip", "link", "set", n + "v", "netns", n)
            sh("ip", "-n", n, "addr", "add", f"{NET}.{i + 1}/24", "dev", n + "v")
            sh("ip", "-n", n, "link", "set", "lo", "up")
            sh("ip", "-n", n, "link", "set", n + "v", "up")
    except subprocess.CalledProcessError as exc:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")
    yield names
    for n in names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_two_nodes_form_the_group_under_plain_mpiexec(two_nodes):
    """Rank 0 on node-a (10.251.7.1), rank 1 on node-b (10.251.7.2): the group forms and all-reduces 1 + 2."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    script = Path(__file__).with_name("mpi_rendezvous_run.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    args = [mpiexec]
    for i, ns in enumerate(two_nodes):
        host = f"node-{'ab'[i]}"
        args += [":"] * (i > 0) + ["-n", "1", "ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                   f"hostname {host} && exec {sys.executable} {script}"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = sorted((json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")), key=lambda d: d["rank"])
    assert got == [{"rank": 0, "host": "node-a", "sum": 3.0}, {"rank": 1, "host": "node-b", "sum": 3.0}]


def test_reach_joins_only_rank_0s_store():
    """`reach` refuses a port where nothing listens and a store that is not rank 0's (another nonce), and joins
    rank 0's, returning this host's address on the route."""
    import socket

    import torch.distributed as dist

    from moe_export.common.mpi import NONCE_KEY, reach

    master = dist.TCPStore("0.0.0.0", 0, 1, True, wait_for_workers=False)
    master.set(NONCE_KEY, "rank0")
    with socket.socket() as s:  # a port with no listener
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="answers on none of its addresses"):
        reach(["127.0.0.1"], closed, 1, "rank0")
    with pytest.raises(RuntimeError, match="answers on none of its addresses"):
        reach(["127.0.0.1"], master.port, 1, "another job")
    store, local = reach(["127.0.0.1"], master.port, 1, "rank0")
    assert local.startswith("127.") and store.get(NONCE_KEY) == b"rank0"

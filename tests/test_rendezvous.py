"""The torch.distributed rendezvous (`common.mpi.torch_group_comms`, used by the torch and TensorRT runners) under
plain `mpiexec` (no MASTER_ADDR): ranks on two "nodes", network namespaces with their own hostnames joined by a veth
pair (namespace addresses only; loopback of one is not the other's), form the group over the veth; ranks on one
node form it over loopback (no traffic to the node's own interface address). Needs root (`ip netns`); skipped
where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from ipaddress import ip_address
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


@pytest.mark.parametrize("placement", ["ab", "aa", "aab"])
def test_the_group_forms_under_plain_mpiexec(two_nodes, placement):
    """Rank r on node placement[r] (node-a: 10.251.7.1, node-b: 10.251.7.2; one kernel, so only the hostname tells
    the nodes apart): the group forms and all-reduces 1 + ... + world. A rank on rank 0's node joins the store
    over 127.0.0.1, a rank on the other node over node-a's veth address and never over loopback; gloo binds to lo
    when the world is on one node (every connection then over loopback), else to the node's veth."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    script = Path(__file__).with_name("mpi_rendezvous_run.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT="29517")  # a port in the test's namespaces: nothing else listens
    args = [mpiexec]
    for rank, node in enumerate(placement):
        args += [":"] * (rank > 0) + ["-n", "1", "ip", "netns", "exec", two_nodes["ab".index(node)], "unshare",
                                      "--uts", "sh", "-c", f"hostname node-{node} && exec {sys.executable} {script}"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    world, one_node = len(placement), len(set(placement)) == 1
    assert [(d["rank"], d["host"], d["sum"]) for d in got] == [
        (rank, f"node-{node}", world * (world + 1) / 2) for rank, node in enumerate(placement)]
    for d, node in zip(got, placement):
        assert d["ifname"] == ("lo" if one_node else two_nodes["ab".index(node)] + "v"), d
        if d["rank"] > 0:
            assert d["store"] == ["127.0.0.1" if node == placement[0] else f"{NET}.1"], d
        if one_node:
            assert d["peers"] and all(ip_address(p).is_loopback for p in d["peers"]), d
        if node != placement[0]:
            assert d["peers"] and not any(ip_address(p).is_loopback for p in d["peers"]), d


def test_store_candidates_loopback_only_on_rank_0s_host():
    """Rank 0's addresses (interface order): its host's ranks try loopback first, other hosts' never."""
    from moe_export.common.mpi import store_candidates

    addresses = ["127.0.0.1", "10.0.0.5", "192.168.1.2"]
    assert store_candidates(addresses, same_host=True) == ["127.0.0.1", "10.0.0.5", "192.168.1.2"]
    assert store_candidates(addresses, same_host=False) == ["10.0.0.5", "192.168.1.2"]


def test_reach_joins_only_rank_0s_store():
    """`reach` refuses a port where nothing listens and a store that is not rank 0's (another nonce), and joins
    rank 0's, returning the address it answered on and this host's address on the route."""
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
    store, used, local = reach(["127.0.0.1"], master.port, 1, "rank0")
    assert used == "127.0.0.1" and local.startswith("127.") and store.get(NONCE_KEY) == b"rank0"


ONE_RANK = """import json, os
from moe_export.common.mapping import Mapping
from moe_export.common.mpi import rendezvous_store
rendezvous_store(Mapping(1, 0, 1, 1), {backend!r})
print(json.dumps([os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")]))
"""


@pytest.mark.parametrize("backend, want", [("gloo", ["lo", None]), ("nccl", [None, "lo"])])
def test_one_host_binds_the_backend_to_loopback(backend, want):
    """A world on one host (one rank, MPI singleton) joins over loopback and binds its backend there: gloo's
    interface, or NCCL's bootstrap interface; the other backend's variable is left unset."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    r = subprocess.run([sys.executable, "-c", ONE_RANK.format(backend=backend)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == want

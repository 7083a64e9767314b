"""Which MPI launcher started this process, if any (the one detection used by `build` and the engines), and the
communicators of a rank's groups (`world_comm`, `mpi_group_comms`, `torch_group_comms`).

Launchers announce a process's place in the world through environment variables:
  - MPICH / Intel MPI (Hydra) and Slurm's PMI-1/2: PMI_RANK, PMI_SIZE;
  - Open MPI (mpirun / prterun):                  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
  - PMIx launchers (srun --mpi=pmix, prterun):    PMIX_RANK (no size variable: asked from MPI).
Nothing imports mpi4py unless one of them is set, so a plain run never initializes MPI.

The rank on its node (`local_rank`, which picks the GPU: local rank -> device) comes from MPI_LOCALRANKID (Hydra),
OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), PMIX_LOCAL_RANK (PMIx) or SLURM_LOCALID (srun), else from MPI itself
(the rank within COMM_WORLD split by shared memory).
"""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Mapping
from ipaddress import ip_address
from pathlib import Path
from typing import Any

from moe_export.common.mapping import Mapping as RankMapping

# (rank variable, size variable or None) per launcher family, in the order they are checked.
LAUNCHER_VARS: tuple[tuple[str, str | None], ...] = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", None),
)


def mpi_world(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, world size) when an MPI launcher started this process, else None.

    A PMIx launch gives the rank only; the size then comes from MPI.COMM_WORLD (mpi4py is imported)."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARS:
        if rank_var not in env:
            continue
        rank = int(env[rank_var])
        if size_var is not None and size_var in env:
            return rank, int(env[size_var])
        if size_var is None:
            from mpi4py import MPI

            return rank, MPI.COMM_WORLD.Get_size()
    return None


LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank among the processes of its node (0 when no MPI launcher started it)."""
    env = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        if var in env:
            return int(env[var])
    if mpi_world(env) is None:
        return 0
    from mpi4py import MPI

    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def device_for_local_rank(local: int, device_count: int, environ: Mapping[str, str] | None = None) -> int:
    """The GPU a rank uses: one GPU per local rank. A launcher that already gave each task its own GPU
    (`srun --gpus-per-task=1`: CUDA_VISIBLE_DEVICES names one device, the local rank may be anything) leaves
    device 0. More local ranks than visible GPUs otherwise is an error (two ranks on one GPU would each size
    their pools for the whole GPU)."""
    env = os.environ if environ is None else environ
    if device_count < 1:
        raise RuntimeError("no CUDA device is visible to this process")
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if device_count == 1 and len(visible) == 1:
        return 0
    if local >= device_count:
        raise RuntimeError(f"local rank {local} but only {device_count} CUDA device(s) visible: start at most "
                           f"{device_count} ranks per node (or fix CUDA_VISIBLE_DEVICES)")
    return local


class SerialWorld:
    """The world of a process no MPI launcher started: one process."""

    rank, size = 0, 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


def world_comm():
    """MPI.COMM_WORLD when an MPI launcher started this process (mpi4py is imported only then), else a
    `SerialWorld`; both have rank, size and allgather."""
    if mpi_world() is None:
        return SerialWorld()
    from mpi4py import MPI

    return MPI.COMM_WORLD


def mpi_group_comms(mapping: RankMapping) -> dict[str, Any]:
    """MPI sub-communicators of this rank's "tp" and "ep" groups (consecutive ranks), split from COMM_WORLD.
    Collective: every rank of the world calls it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return {kind: world.Split(mapping.group_index(kind), mapping.rank) for kind in ("tp", "ep")}


PROBE_TIMEOUT_S = 2.0  # a TCP connect to one of rank 0's addresses: refused / unreachable fail at once
STORE_TIMEOUT_S = 300  # torch.distributed's default store timeout, once the store is found
NONCE_KEY = "moe_export/rendezvous"


def host_addresses() -> list[str]:
    """This host's IPv4 addresses on interfaces that are up, in interface order."""
    import psutil

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    return [a.address for name, addrs in psutil.net_if_addrs().items() if name in up
            for a in addrs if a.family == socket.AF_INET]


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # random per boot of a Linux kernel


def host_identity() -> tuple[str, str]:
    """(hostname, kernel boot id): equal for two processes only on one host (network namespaces with their own
    hostname, as containers, count as other hosts)."""
    return socket.gethostname(), BOOT_ID.read_text().strip()


def store_candidates(addresses: list[str], same_host: bool) -> list[str]:
    """Rank 0's `addresses` in the order a rank tries them: on rank 0's host loopback first (then the others),
    on another host the others only (loopback there is that host's own)."""
    others = [a for a in addresses if not ip_address(a).is_loopback]
    return [a for a in addresses if ip_address(a).is_loopback] + others if same_host else others


def interface_of(address: str) -> str:
    """The name of the interface holding local IPv4 `address`."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise RuntimeError(f"no network interface of this host holds {address}")


def reach(candidates: list[str], port: int, world_size: int, nonce: str):
    """(rank 0's TCPStore, the candidate it answered on, this host's address on the route to it) over the first of
    `candidates` where a store on `port` answers with rank 0's `nonce` (a port of another host's server is
    skipped, not joined)."""
    from datetime import timedelta

    import torch.distributed as dist

    for addr in candidates:
        try:
            with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S) as s:
                local = s.getsockname()[0]
            store = dist.TCPStore(addr, port, world_size, False, timeout=timedelta(seconds=PROBE_TIMEOUT_S))
            if store.get(NONCE_KEY).decode() == nonce:
                store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
                return store, addr, local
        except (OSError, RuntimeError):
            continue
    raise RuntimeError(f"rank 0's rendezvous (port {port}) answers on none of its addresses {candidates}: "
                       "set MASTER_ADDR to an address of rank 0's host that every node reaches")


def rendezvous_store(mapping: RankMapping, backend: str):
    """The world's TCPStore (see `torch_group_comms`). Collective over COMM_WORLD."""
    import secrets

    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    offer = None
    if mapping.rank == 0:
        port = os.environ.get("MASTER_PORT")
        master = dist.TCPStore("0.0.0.0", int(port or 0), mapping.world_size, True, wait_for_workers=False)
        master.set(NONCE_KEY, secrets.token_hex(8))
        offer = (os.environ.get("MASTER_ADDR"), host_addresses(), master.port, master.get(NONCE_KEY).decode())
    master_addr, addresses, port, nonce = world.bcast(offer, root=0)
    hosts = world.allgather(host_identity())
    same_host = hosts[mapping.rank] == hosts[0]
    candidates = [master_addr] if master_addr else store_candidates(addresses, same_host)
    store, used, local = reach(candidates, port, mapping.world_size, nonce)
    one_host = all(h == hosts[0] for h in hosts)
    ifname = interface_of(local)
    if not master_addr and not one_host:  # ranks on rank 0's host came over loopback: their interface for gloo is
        reached = world.allgather(used)  # the one holding the address that the other hosts reached
        if same_host:
            ifname = interface_of(next(a for a, h in zip(reached, hosts) if h != hosts[0]))
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    elif one_host:  # NCCL's bootstrap on loopback too (across hosts it picks its own interfaces)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    return master if mapping.rank == 0 else store


def torch_group_comms(mapping: RankMapping, backend: str, device=None, timeout_s: float | None = None) -> dict[str, Any]:
    """torch.distributed process groups of this rank's "tp" and "ep" groups over `backend` ("nccl" on GPUs,
    "gloo" on CPU). `device`: this rank's torch.device; a CUDA one is made the current device first (as vLLM's
    `Worker.init_device`), so NCCL's communicators are made on it.

    The rendezvous is a TCPStore served by rank 0 on every interface, on MASTER_PORT or a free port; rank 0
    broadcasts over COMM_WORLD its port and its addresses (MASTER_ADDR when set, else every up interface's). A rank
    on rank 0's host (`host_identity`) tries loopback first, a rank on another host the other addresses only, and
    each takes the first it reaches (`reach`). gloo then binds each rank to one interface (GLOO_SOCKET_IFNAME, unless
    set): loopback when the whole world is on one host (NCCL's bootstrap too: NCCL_SOCKET_IFNAME, unless set), else
    the interface on the route between the hosts, so ranks on several hosts find each other whatever their hostnames
    resolve to. Collective: every rank calls it, and every rank creates every group (torch.distributed requires it).
    `timeout_s`: the collectives' timeout (torch's default when None). gloo's groups are destroyed at exit
    (`destroy_groups`)."""
    import datetime

    import torch
    import torch.distributed as dist

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=rendezvous_store(mapping, backend), rank=mapping.rank,
                                world_size=mapping.world_size, timeout=timeout)
        if backend == "gloo":
            atexit.register(destroy_groups)  # (after MPI's start: runs before its finalize)
    mine = {}
    for kind in ("tp", "ep"):
        for ranks in mapping.groups(kind):
            group = dist.new_group(list(ranks))
            if mapping.rank in ranks:
                mine[kind] = group
    return mine


def destroy_groups() -> None:
    """Destroy this process's torch.distributed groups while the interpreter is whole (registered at exit by
    `torch_group_comms` for gloo): left to the interpreter's teardown, gloo's worker threads may still hold the
    tensors of the last collectives, whose release then needs a Python that is gone, and the process ends in
    std::terminate ("terminate called without an active exception"; pytorch/pytorch#190489). Local: no rank waits
    for another."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

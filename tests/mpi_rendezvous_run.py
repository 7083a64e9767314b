"""Run under `mpiexec -n WORLD`, each rank in a network namespace with a hostname (`test_rendezvous.py`), with
MASTER_PORT set and no MASTER_ADDR: the torch runner's `DistributedWorld` (gloo, ep WORLD) forms its groups and
answers one all-reduce; rank 0 prints every rank's {"rank", "host", "sum", "ifname": GLOO_SOCKET_IFNAME, "store": the
addresses its connections to rank 0's store went to (None on rank 0, which serves it), "peers": the addresses of all
its TCP connections} as one JSON list."""

from __future__ import annotations

import json
import os
import socket
from ipaddress import ip_address

import psutil
import torch
from mpi4py import MPI

from moe_export.common.mapping import Mapping
from moe_export.runtime.engine.torch_collectives import AllReduce, DistributedWorld


def ipv4(address: str) -> str:
    """`address` as IPv4 when it is one mapped into IPv6 (the store's client socket is IPv6: ::ffff:a.b.c.d)."""
    ip = ip_address(address)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else address


def main() -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    world = DistributedWorld(Mapping(size, rank, 1, size), torch.device("cpu"))
    total = world.answer(AllReduce(torch.tensor([float(rank + 1)]), "ep"), 0, [])
    conns = [c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED]
    port = int(os.environ["MASTER_PORT"])
    store = sorted({ipv4(c.raddr.ip) for c in conns if c.raddr.port == port}) if rank else None
    row = {"rank": rank, "host": socket.gethostname(), "sum": total.item(), "ifname": os.environ["GLOO_SOCKET_IFNAME"],
           "store": store, "peers": sorted({ipv4(c.raddr.ip) for c in conns})}
    rows = MPI.COMM_WORLD.gather(row, root=0)  # every rank has seen its connections before any closes them
    if rank == 0:
        print(json.dumps(rows), flush=True)
    world.dist.destroy_process_group()


if __name__ == "__main__":
    main()

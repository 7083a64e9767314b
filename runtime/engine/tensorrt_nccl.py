"""The TensorRT runner's communicators: MPI for the host side, torch.distributed NCCL groups for the engine's
collective plugins, with the NCCL settings the runner needs (why each, below)."""

from __future__ import annotations

import os

from moe_export.common.mpi import torch_group_comms
from moe_export.common.mapping import Mapping
from moe_export.runtime.engine.ranks import MPICommunicator

# NCCL settings of the engine's communicators, set before they exist (an explicit environment setting wins):
#  - NCCL_NVLS_ENABLE=0: NVLink SHARP (NCCL's default on NVSwitch systems of Hopper GPUs, as the H100 and H200
#    nodes) allocates multicast buffers per communicator that `plan` does not count (plan_memory counts the ring
#    and p2p buffers of NCCL_BUFFSIZE); the engine's collectives are decode-sized, latency-bound all-reduces and
#    all-to-alls that the ring / tree LL protocols serve, so it is turned off rather than counted (NCCL user
#    guide, env.html NCCL_NVLS_ENABLE; usage/bufferreg.html "NVLink Sharp Buffer Registration").
#  - NCCL_GRAPH_MIXING_SUPPORT=1 (NCCL's default, pinned): the runner mixes eager steps (prefills, each decode
#    bucket's first step) and CUDA-graph replays on the same communicators, which NCCL supports only with it on
#    (NCCL user guide, env.html NCCL_GRAPH_MIXING_SUPPORT; usage/cudagraph.html "Using NCCL with CUDA Graphs").
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_MIXING_SUPPORT": "1"}
# The NCCL watchdog's timeout (torch's default for NCCL: 10 minutes). The first eager step JIT-compiles the
# plugins' Triton kernels between its collectives (every kernel variant of 93 layers' plugins, minutes on a cold
# cache), so a rank that compiled first waits inside a collective for the slowest; 30 minutes covers that warm-up.
NCCL_TIMEOUT_S = 30 * 60


class NcclGroups(MPICommunicator):
    """The host side over MPI (step plans broadcast in the world, or in the attention group in the dp layout; the
    group leaders' communicator; group sums: `ranks.MPICommunicator`, so `runtime/core/wide_ep.py` runs as is) and
    the engine's side: torch.distributed NCCL world plus the tp and ep groups (consecutive ranks), set up from
    MPI's launch: rank 0's host and a free port are broadcast over MPI (or MASTER_ADDR / MASTER_PORT if set).
    Registers a communicator per group (`nccl`) for the engine's collective plugins."""

    def __init__(self, mapping: Mapping):
        from moe_export.plugins.collectives.nccl import Communicator, set_communicators

        super().__init__(mapping)
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)  # before any communicator exists; an explicit setting wins
        groups = torch_group_comms(mapping, "nccl", timeout_s=NCCL_TIMEOUT_S)
        self.nccl = {kind: Communicator(group, mapping.group_size(kind)) for kind, group in groups.items()}
        set_communicators(self.nccl)

    def warm_up(self, torch, device) -> None:
        """Make the groups' NCCL communicators now (torch.distributed makes one at a group's first collective,
        which would otherwise be inside the first request's step): a one-element all-reduce per group, tp first,
        then ep, the same order on every rank (the tp groups are disjoint, as are the ep groups)."""
        for name in ("tp", "ep"):
            probe = torch.zeros(1, device=device)
            self.nccl[name].all_reduce(probe, probe)

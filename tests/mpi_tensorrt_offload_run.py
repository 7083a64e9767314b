"""Run under `mpiexec -n 2` on a tp-2 TensorRT engine folder (argv[1]): every rank opens the TensorRT runner through
its real constructor over the stand-ins of TensorRT's runtime and of torch.cuda (`tensorrt_runtime_standin.py`:
host tensors for the "cuda" pools, nothing computed), with its communicators' torch.distributed groups on gloo in
place of NCCL (no GPU here; the host side is MPI as on a GPU), then runs `mpi_offload_run.offload_turn` (the
ONNX Runtime / torch runners' offload turn: store argv[2], prompt argv[3], argv[4] greedy tokens).

The stand-in's steps write no pool row and no logits (zeroed after each step, so greedy sampling takes token 0), so the rows the offload reads are the ones this script writes first: every
row of every pool of rank R, in generation G (argv[5]), holds `row_pattern(G, R, pool, row)` (filled once the runner
is open; a state slot again each time the runner resets it, after its zeroing). With argv[6], the kept session of an
earlier generation-1 run ({"slot", "blocks"}: its slot and block table), every load the runner is given (its
`write_slot` / `write_blocks`) is checked right after it is written: the pool rows it names hold, bit for bit, that
run's rows of this rank (its slot's state rows, which a checkpoint of that run copied, then its block rows in table
order).

Rank 0 prints `offload_turn`'s JSON line plus "kept" (this run's last kept session: slot, blocks, tokens) and "loads"
(per rank: {"slots", "blocks"}: the state slots and block rows written by loads, "bad": rows that differ)."""

from __future__ import annotations

import json
import sys

import numpy as np
import tensorrt_runtime_standin as rt
import torch
from moe_export.common import mpi
from moe_export.common.engine_config import EngineConfig
from moe_export.common.model_config import ModelConfig
from moe_export.plugins import tensorrt_runtime
from moe_export.runtime.core.state_offload import StateOffload
from moe_export.runtime.engine import open_engine, tensorrt_nccl
from moe_export.runtime.engine.batch import RESET_ON_NEW_SEQUENCE
from moe_export.runtime.engine.tensorrt import read_engine_meta
from mpi_offload_run import offload_turn
from mpi4py import MPI

NUM_BLOCKS = 64  # cache blocks per rank (the build's plan allows far more): every row gets a pattern


def row_pattern(gen: int, rank: int, pool: int, row: int, nbytes: int) -> np.ndarray:
    """The bytes [nbytes] of row `row` of pool number `pool` (pool table order) of `rank` in generation `gen`: each
    byte below 64, so the row is finite in any float dtype (sign 0, exponent never all ones)."""
    return np.random.default_rng([gen, rank, pool, row]).integers(0, 64, nbytes, dtype=np.uint8)


def row_bytes(pool: torch.Tensor, row: int) -> torch.Tensor:
    """Row `row` of `pool` as a uint8 view (writes through it land in the pool)."""
    return pool[row].reshape(-1).view(torch.uint8)


def fill(engine, gen: int, rows_of) -> None:
    """Write `row_pattern(gen, ...)` into the rows `rows_of(name, pool)` of every pool of this rank's runner."""
    for p, (name, pool) in enumerate(engine.pools.items()):
        for row in rows_of(name, pool):
            view = row_bytes(pool, row)
            view.copy_(torch.from_numpy(row_pattern(gen, engine.rank, p, row, view.numel())))


def open_runner(engine_dir: str):
    """This rank's TensorRT runner through `open_engine` (its real constructor) over the stand-ins, as
    tests/test_tensorrt_runner_start.py opens it; the plugins' registration and the GPU choice are skipped (nothing
    runs a plugin or a GPU here) and the engine's torch.distributed groups use gloo."""
    config = EngineConfig.read(engine_dir)
    rank = MPI.COMM_WORLD.Get_rank()
    meta, _, _ = read_engine_meta(f"{engine_dir}/rank{rank}/rank{rank}.engine")
    vocab = ModelConfig.from_hf_dict(config.pretrained_config, source="config.json").vocab_size
    sys.modules["tensorrt"] = rt.runtime_module(b"engine-bytes", meta, vocab)
    tensorrt_runtime.register_plugins = lambda: None
    tensorrt_runtime.select_device = lambda: 0
    tensorrt_nccl.torch_group_comms = lambda mapping, backend, **kw: mpi.torch_group_comms(mapping, "gloo", **kw)
    sys.modules["torch"] = rt.cpu_torch()
    try:
        return open_engine(engine_dir, num_blocks=NUM_BLOCKS)
    finally:
        sys.modules["torch"] = torch


def main() -> None:
    engine_dir, store, prompt, n, gen = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    earlier = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    engine = open_runner(engine_dir)
    state = [name for name in engine.pools if name.startswith(RESET_ON_NEW_SEQUENCE)]
    fill(engine, gen, lambda name, pool: range(pool.shape[0]))
    reset = engine.reset_slot

    def reset_then_fill(slot: int) -> None:
        reset(slot)
        fill(engine, gen, lambda name, pool: [slot] if name in state else [])

    engine.reset_slot = reset_then_fill
    forward = engine._forward

    def forward_with_finite_logits(batch):
        """The stand-in computes no logits (their buffer holds whatever the allocator left, NaN included, and a
        step whose logits are all NaN samples nothing): zeros, so greedy sampling takes token 0."""
        return forward(batch).zero_()

    engine._forward = forward_with_finite_logits
    loads = {"slots": 0, "blocks": 0, "bad": []}
    index = {name: p for p, name in enumerate(engine.pools)}

    def check(name: str, row: int, earlier_row: int) -> None:
        got = row_bytes(engine.pools[name], row).numpy()
        if not np.array_equal(got, row_pattern(1, engine.rank, index[name], earlier_row, got.size)):
            loads["bad"].append(f"rank {engine.rank} {name} row {row} (from row {earlier_row})")

    write_slot, write_blocks = engine.write_slot, engine.write_blocks

    def checked_write_slot(slot: int, rows) -> None:
        write_slot(slot, rows)
        loads["slots"] += 1
        for name in state:
            check(name, slot, earlier["slot"])

    def checked_write_blocks(blocks: list[int], rows) -> None:
        write_blocks(blocks, rows)
        loads["blocks"] += len(blocks)
        for j, block in enumerate(blocks):  # a load writes the stored prefix's blocks in table order
            for name in engine.pools:
                if name not in state:
                    check(name, block, earlier["blocks"][j])

    if earlier is not None:
        engine.write_slot, engine.write_blocks = checked_write_slot, checked_write_blocks
    kept = {}
    session_kept = StateOffload.session_kept

    def record_kept(self, tokens, hashes, slot, blocks) -> None:
        kept.update(slot=int(slot), blocks=[int(b) for b in blocks], tokens=len(tokens))
        session_kept(self, tokens, hashes, slot, blocks)

    StateOffload.session_kept = record_kept
    out = offload_turn(engine, engine_dir, store, prompt, n)
    every = MPI.COMM_WORLD.gather(loads, root=0)
    if out is not None:
        print(json.dumps({**out, "kept": kept, "loads": every}))


if __name__ == "__main__":
    main()

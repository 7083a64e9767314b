"""Engine runner: executes a built engine directory's per-rank ONNX Runtime segments.

Each rank runs its segments in order (`rank{N}/ort_plan.json`); between segments sit the graph's
collectives. Two ways to run a world of R ranks:
  - under `mpiexec -n R`: this process is one rank, collectives go through MPI (mpi4py);
  - in one process (no mpiexec): every rank is loaded here and run in lockstep, collectives are
    computed in process (same sums, same order), which is handy for tests and small models.
In the `dp` layout (`graphs/sharding.py`) each attention group runs its own batch: under mpiexec `step(batch)`
is this rank's group's step and `step(None)` an idle one (the group joins the MoE all-to-alls with zero tokens
and computes what the others send its experts); in one process `step_groups` takes one batch (or None) per group.
State lives in pools owned by the runner and is updated in place at O(tokens) per step:
  - recurrent state (KDA state fp32, conv windows): `num_slots` slots, a sequence occupies one; the
    graph returns the new state of the step's slots only, written back at `slot_ids`;
  - caches (MLA latent, DSA indexer keys): one paged pool per layer, [num_blocks, block_size, D] in the
    recipe's kv_cache dtype (fp32 / bf16, or fp8: uint8 rows of E4M3 codes + an E8M0 scale byte, see
    `moe_export.quantize.fp8_cache`); a sequence owns the blocks of its block table; the graph reads
    earlier rows through the block tables and returns the step's new rows, written back at each token's
    physical row `block_tables[n, pos // block_size] * block_size + pos % block_size` by the PagedCacheWrite CPU
    kernel (`plugins/paged_cache_write/cpu.py`).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import torch
from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.common.mapping import Mapping
from moe_export.common.mpi import mpi_world
from moe_export.common.ort_plan import CollectiveStep, OrtPlan, PlanStep, SegmentStep
from moe_export.graphs.vision_export import VISION_GRAPH
from moe_export.plugins.collectives import all_to_all
from moe_export.plugins.paged_cache_write.cpu import paged_cache_write_
from moe_export.runtime.engine.batch import (
    RESET_ON_NEW_SEQUENCE,
    STATE_PREFIXES,
    StepBatch,
    check_blocks,
    check_checkpoint,
    check_slot,
    check_step_batch,
    checkpoint_interval,
)
from moe_export.runtime.engine.ranks import MPICommunicator, rank_folders
from moe_export.runtime.engine.runner import choose_tokens
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch
from onnx import TensorProto

POOL_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.BFLOAT16: ml_dtypes.bfloat16,
               TensorProto.UINT8: np.uint8}  # ONNX -> numpy (uint8: fp8 rows with their scale byte)


def torch_view(pool: np.ndarray) -> torch.Tensor:
    """The pool's memory as a torch tensor (no copy; bf16 through an int16 view)."""
    if pool.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(pool.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(pool)


# glibc malloc for the step temporaries (the sessions run without ORT arenas, see `RankRunner.load`): by default
# glibc adapts its mmap threshold (from 128 KiB up to 32 MiB) and trims the heap's free top above twice it, so a
# step's MB-sized temporaries went back to the kernel op after op and came back as fresh zeroed pages (~30,000
# minor page faults per 192-token prefill step of tiny-k3 on 4 ranks in process). Fixed: every temporary under
# 32 MiB (glibc's own maximum threshold; the attention bodies' key tiles are a quarter of it) comes from the
# heap, and up to 128 MiB of free heap top is kept for the next op instead of trimmed (a few faults per step).
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_step_memory() -> bool:
    """Set glibc's malloc thresholds for the step temporaries (process-wide; setting them again changes nothing);
    True if set. Not on another C library (no `mallopt`) or when the user tuned glibc malloc themselves
    (MALLOC_*_ or GLIBC_TUNABLES)."""
    import ctypes

    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


@dataclass
class RankRunner:
    """One rank's ORT sessions and state pools."""

    mapping: Mapping
    steps: tuple[PlanStep, ...]
    sessions: dict[str, object]
    pools: dict[str, np.ndarray] = field(default_factory=dict)
    pool_feeds: dict[str, object] = field(default_factory=dict)  # what ORT is fed: the array, or a bf16 view of it
    checkpoints: dict[str, np.ndarray] = field(default_factory=dict)  # recurrent pools' checkpoint rows
    traffic: all_to_all.Traffic = field(default_factory=all_to_all.Traffic)

    def __post_init__(self) -> None:
        # segments fed by a MoEDispatch only (the expert op on the received rows; idle ranks run them too) ->
        # the dispatch's received rows value
        self.expert_segments: dict[str, str] = {}
        for prev, step in zip(self.steps, self.steps[1:]):
            if (isinstance(prev, CollectiveStep) and prev.op == "MoEDispatch" and isinstance(step, SegmentStep)
                    and set(step.inputs) <= set(prev.outputs)):
                self.expert_segments[step.segment] = prev.outputs[0]

    @property
    def rank(self) -> int:
        return self.mapping.rank

    @classmethod
    def load(cls, rank_dir: Path, num_slots: int, num_blocks: int, block_size: int, threads: int) -> RankRunner:
        import onnxruntime as ort

        plan = OrtPlan.read(rank_dir)
        graph = onnx.load(str(rank_dir / "model.onnx"), load_external_data=False)
        meta = {p.key: p.value for p in graph.metadata_props}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # Many small sessions share two cores: spinning worker threads would starve each other.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # No per-session arena: an arena keeps its high-water mark after each run, and a rank has one session
        # per segment, so every attention segment would hold its largest step's [T, context, D] temporaries
        # for good (4 ranks x 3 MLA layers of tiny-k3: 7.5 GB after a 2,000-token prefill). Freed to malloc,
        # the temporaries of one op at a time are live.
        opts.enable_cpu_mem_arena = False
        segments = [step.segment for step in plan.steps if isinstance(step, SegmentStep)]
        # ORT builds a session (graph optimization included) without holding the GIL: one thread per core loads
        # them (23 segments per rank of tiny-k3: 1.3 s one after another, 0.7 s on 2 cores)
        with ThreadPoolExecutor(max(1, min(len(segments), os.cpu_count() or 1))) as pool:
            sessions = dict(zip(segments, pool.map(
                lambda segment: ort.InferenceSession(str(rank_dir / segment), opts, providers=["CPUExecutionProvider"]),
                segments)))
        sizes = {"S": num_slots, "NB": num_blocks, "BS": block_size}
        pools, pool_feeds = {}, {}
        for vi in graph.graph.input:
            if vi.name.startswith(STATE_PREFIXES):
                dims = [d.dim_value if d.HasField("dim_value") else sizes[d.dim_param] for d in vi.type.tensor_type.shape.dim]
                elem = vi.type.tensor_type.elem_type
                pool = pools[vi.name] = np.zeros(dims, dtype=POOL_DTYPES[elem])
                # numpy has no bf16 that ORT reads: feed the same memory as an OrtValue (no copy, so the
                # in-place writes below are what the next step sees)
                pool_feeds[vi.name] = pool if elem != TensorProto.BFLOAT16 else \
                    ort.OrtValue.ortvalue_from_numpy_with_onnx_type(pool.view(np.uint16), elem)
        return cls(Mapping.from_dict(json.loads(meta["mapping"])), plan.steps, sessions, pools, pool_feeds)

    def reset_slot(self, slot: int) -> None:
        for name, pool in self.pools.items():
            if name.startswith(RESET_ON_NEW_SEQUENCE):
                pool[slot] = 0.0


    def make_checkpoints(self, num_checkpoints: int) -> None:
        """The checkpoint pool: `num_checkpoints` copies of one slot's rows of every recurrent-state pool."""
        self.checkpoints = {name: np.zeros((num_checkpoints, *pool.shape[1:]), dtype=pool.dtype)
                            for name, pool in self.pools.items() if name.startswith(RESET_ON_NEW_SEQUENCE)}

    def save_state(self, slot: int, checkpoint: int) -> None:
        for name, rows in self.checkpoints.items():
            rows[checkpoint] = self.pools[name][slot]

    def restore_state(self, slot: int, checkpoint: int) -> None:
        for name, rows in self.checkpoints.items():
            self.pools[name][slot] = rows[checkpoint]

    def state_layout(self) -> dict[str, list]:
        """`OffloadRunner.state_layout` of this rank's pools (keys `{rank}/{pool}`)."""
        return {f"{self.rank}/{name}": ["state" if name.startswith(RESET_ON_NEW_SEQUENCE) else "cache",
                                        pool[0].nbytes, str(pool.dtype), list(pool.shape[1:])]
                for name, pool in self.pools.items()}

    def read_rows(self, kind: str, index) -> dict[str, np.ndarray]:
        """Raw bytes of a slot's (`kind` "slot"), a checkpoint's ("checkpoint": [bytes] each) or blocks' ("blocks":
        index a list, [n, bytes] each) rows, by `{rank}/{pool}`."""
        if kind == "blocks":
            return {f"{self.rank}/{n}": p[index].reshape(len(index), -1).view(np.uint8).copy()
                    for n, p in self.pools.items() if not n.startswith(RESET_ON_NEW_SEQUENCE)}
        pools = self.pools if kind == "slot" else self.checkpoints
        return {f"{self.rank}/{n}": pools[n][index].reshape(-1).view(np.uint8).copy() for n in self.checkpoints}

    def write_rows(self, kind: str, index, rows: dict) -> None:
        """Write raw bytes read by `read_rows` back into a slot ("slot": [bytes] per pool) or blocks ("blocks": per pool
        the blocks' rows in `index` order, [n, bytes] or n rows of [bytes]; each written straight into its place)."""
        for n, pool in self.pools.items():
            if n.startswith(RESET_ON_NEW_SEQUENCE) != (kind == "slot"):
                continue
            if kind == "slot":
                data = np.ascontiguousarray(rows[f"{self.rank}/{n}"], dtype=np.uint8)
                pool[index] = data.view(pool.dtype).reshape(pool.shape[1:])
                continue
            pool_bytes = pool.view(np.uint8).reshape(pool.shape[0], -1, copy=False)  # the pool's memory, never a copy
            for block, row in zip(index, rows[f"{self.rank}/{n}"], strict=True):
                pool_bytes[block] = row

    def write_back(self, env: dict[str, np.ndarray], batch: StepBatch) -> None:
        """Store the step's new state in place: the touched slots' recurrent state at `slot_ids`, the new
        cache rows [T, D] (fp32, already rounded to the pool dtype) at each token's block-table row with the
        PagedCacheWrite CPU kernel (fp8 rows encoded with their scale byte)."""
        feeds = {k: torch.from_numpy(v) for k, v in (("cu", batch.cu_seqlens), ("tables", batch.block_tables),
                                                       ("positions", batch.positions))}  # fmt: skip
        for name, pool in self.pools.items():
            new = env[f"{name}.out"]
            if name.startswith(RESET_ON_NEW_SEQUENCE):
                pool[batch.slot_ids] = new
            else:
                paged_cache_write_(torch_view(pool), torch.from_numpy(new), feeds["cu"], feeds["tables"], feeds["positions"])

    def run_experts(self, step: SegmentStep, env: dict[str, np.ndarray]) -> None:
        """An expert segment; with no rows received its outputs are empty [0, D] (nothing to run)."""
        recv_x = env[self.expert_segments[step.segment]]
        if recv_x.shape[0]:
            self.run_segment(step, env)
        else:
            env.update({o: np.zeros((0, recv_x.shape[1]), dtype=recv_x.dtype) for o in step.outputs})

    def run_segment(self, step: SegmentStep, env: dict[str, np.ndarray]) -> None:
        sess = self.sessions[step.segment]
        outs = sess.run(list(step.outputs), {name: env[name] for name in step.inputs})
        env.update(zip(step.outputs, outs))


class Engine:
    """A built engine directory, with the ranks this process runs (all of them, or its MPI rank).

    num_slots: concurrent sequences (recurrent-state slots, default the recipe's max_batch); num_blocks:
    cache blocks of `block_size` tokens in each paged pool (default: the planner's `pool_sizes`, i.e.
    the rank's memory left after weights, workspace, the slots and the checkpoints, per block); max_step_pairs: most (step token,
    attended position) pairs the scheduler packs into one step (default None: no such bound, the attention bodies
    stream over key tiles, so a step's temporaries do not grow with its context); num_checkpoints: recurrent-state checkpoints for prefix
    caching (default the recipe's limits.checkpoints_per_slot x num_slots; host memory, like every pool of this runner,
paid from the same budget)."""

    def __init__(self, engine_dir: str | Path, *, num_slots: int | None = None, num_blocks: int | None = None,
                 threads: int | None = None, max_step_pairs: int | None = None, num_checkpoints: int | None = None):
        self.dir = Path(engine_dir)
        self.config = EngineConfig.read(self.dir)
        rank_dirs = rank_folders(self.dir)
        self.world_size = len(rank_dirs)
        limits = self.config.limits
        self.num_slots = num_slots or limits.max_batch
        self.max_seq_len, self.max_num_tokens, self.block_size = limits.max_seq_len, limits.max_num_tokens, limits.block_size
        if num_checkpoints is not None and num_checkpoints < 0:
            raise InputError(f"num_checkpoints must be at least 0, got {num_checkpoints}")
        self.num_checkpoints = limits.checkpoints_per_slot * self.num_slots if num_checkpoints is None else num_checkpoints
        self.num_blocks = num_blocks or self.config.memory.pool_sizes(self.block_size, self.num_slots,
                                                                      self.num_checkpoints).num_blocks
        if max_step_pairs is not None and max_step_pairs < 1:
            raise InputError(f"max_step_pairs must be at least 1, got {max_step_pairs}")
        self.max_step_pairs = max_step_pairs
        if self.num_blocks < 1:
            raise InputError(f"{self.dir}: no memory left for cache blocks with {self.num_slots} slots "
                             "(see `moe-export plan`); pass fewer slots or num_blocks")
        mpi = mpi_world()
        if mpi is not None and mpi[1] > 1:
            rank, size = mpi
            if size != self.world_size:
                raise InputError(f"{self.dir}: engine has {self.world_size} ranks but mpiexec started {size} processes")
            local = [rank]
        else:
            local = list(range(self.world_size))
        per_proc_threads = threads or max(1, (os.cpu_count() or 1) // (1 if mpi is None else mpi[1]))
        keep_step_memory()
        self.ranks = [RankRunner.load(rank_dirs[r], self.num_slots, self.num_blocks, self.block_size, per_proc_threads)
                      for r in local]
        for r, runner in zip(local, self.ranks):
            if runner.rank != r:
                raise InputError(f"{rank_dirs[r]}: its graph holds the mapping of rank {runner.rank}, not rank {r}")
        for runner in self.ranks:
            runner.make_checkpoints(self.num_checkpoints)
        self.checkpoint_interval = checkpoint_interval(
            {name: (pool.shape, pool.itemsize) for name, pool in self.ranks[0].pools.items()}, self.block_size,
            self.max_num_tokens)
        m = self.ranks[0].mapping
        self.tp, self.ep = m.tp, m.ep
        self.dp_layout = m.all_to_all
        self.dp = m.dp  # attention groups with their own batches (dp layout)
        self.comm = MPICommunicator(m) if len(local) == 1 and self.world_size > 1 else None
        self.model_config: dict = self.config.pretrained_config
        cfg = self.config.model
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_token
        self.moe_dim = cfg.routed_expert_hidden_size or cfg.hidden_size  # rows the MoE collectives carry
        self.vision = None  # K3's tower (`engine.vision`), when the engine has one
        if (self.dir / VISION_GRAPH).is_file():
            from moe_export.runtime.engine.vision import VisionEncoder

            self.vision = VisionEncoder(self.dir, self.config, per_proc_threads)
        self.image_width = cfg.hidden_size if self.vision is not None else None
        self.media_pad_id = self.model_config.get("media_placeholder_token_id")
        dispatches = [s.outputs[0] for s in self.ranks[0].steps if isinstance(s, CollectiveStep) and s.op == "MoEDispatch"]
        self._moe_layer = {name: k for k, name in enumerate(dispatches)}
        # tokens routed to each expert (rows of this process's ranks' dispatches), per MoE layer: the last step's
        # and the running total (dp layout: the runtime sees the routing at the dispatch); group_step_expert_tokens:
        # the last step's of this rank's whole attention group (on its first rank, under mpiexec)
        self.step_expert_tokens = np.zeros((len(dispatches), self.num_experts), dtype=np.int64)
        self.expert_tokens = np.zeros_like(self.step_expert_tokens)
        self.group_step_expert_tokens = self.step_expert_tokens

    @property
    def is_root(self) -> bool:
        return self.comm is None or self.comm.world.Get_rank() == 0

    @property
    def group(self) -> int:
        """This process's attention group (dp layout under mpiexec; 0 otherwise)."""
        return self.ranks[0].mapping.dp_rank if self.comm is not None else 0

    @property
    def traffic(self) -> all_to_all.Traffic:
        """Bytes this process's ranks sent to other ranks, by collective, and the MoE tokens they routed."""
        total = all_to_all.Traffic()
        for r in self.ranks:
            for kind, n in r.traffic.sent_bytes.items():
                total.add(kind, n)
            total.moe_tokens += r.traffic.moe_tokens
        return total

    def reset_slot(self, slot: int) -> None:
        """Start a new sequence in `slot`: zero its recurrent state."""
        check_slot(self, slot)
        for r in self.ranks:
            r.reset_slot(slot)

    def save_state(self, slot: int, checkpoint: int) -> None:
        """`ModelRunner.save_state`: copy the slot's recurrent rows into the checkpoint, on every local rank."""
        check_checkpoint(self, slot, checkpoint)
        for r in self.ranks:
            r.save_state(slot, checkpoint)

    def restore_state(self, slot: int, checkpoint: int) -> None:
        """`ModelRunner.restore_state`: copy the checkpoint into the slot's recurrent rows, on every local rank."""
        check_checkpoint(self, slot, checkpoint)
        for r in self.ranks:
            r.restore_state(slot, checkpoint)

    # ---- `OffloadRunner`: raw rows for the offload store (`runtime.core.state_offload`) ----
    def state_layout(self) -> dict[str, list]:
        return {k: v for r in self.ranks for k, v in r.state_layout().items()}

    def read_slot(self, slot: int) -> dict[str, np.ndarray]:
        check_slot(self, slot)
        return {k: v for r in self.ranks for k, v in r.read_rows("slot", slot).items()}

    def read_checkpoint(self, checkpoint: int) -> dict[str, np.ndarray]:
        check_checkpoint(self, 0, checkpoint)
        return {k: v for r in self.ranks for k, v in r.read_rows("checkpoint", checkpoint).items()}

    def write_slot(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        check_slot(self, slot)
        for r in self.ranks:
            r.write_rows("slot", slot, rows)

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        check_blocks(self, blocks)
        return {k: v for r in self.ranks for k, v in r.read_rows("blocks", list(blocks)).items()}

    def write_blocks(self, blocks: list[int], rows: dict) -> None:
        check_blocks(self, blocks)
        for r in self.ranks:
            r.write_rows("blocks", list(blocks), rows)

    @staticmethod
    def _traffic_kind(step: CollectiveStep) -> str:
        """Traffic key of a collective step: the routed experts' exchange (`moe_*`) or the tp group's own."""
        if step.all_to_all:
            return all_to_all.KIND
        if step.group == "ep":
            return "moe_all_reduce"
        return "moe_all_gather" if step.output.endswith(".token_all_gather") else f"tp_{step.op}"

    def _count(self, rank: int, step: CollectiveStep, x: np.ndarray, size: int) -> None:
        kind, nbytes = self._traffic_kind(step), x.nbytes
        runner = next(r for r in self.ranks if r.rank == rank)
        if step.op == "AllReduce":
            runner.traffic.add(kind, all_to_all.all_reduce_ring_bytes(nbytes, size))
            if kind == "moe_all_reduce":  # every rank of the group holds the same T tokens: a 1/size share each
                runner.traffic.moe_tokens += x.shape[0] / size
        else:
            runner.traffic.add(kind, (size - 1) * nbytes)

    def _collective(self, step: CollectiveStep, envs: dict[int, dict], active: dict[int, bool]) -> None:
        if step.all_to_all:
            self._all_to_all(step, envs, active)
            return
        src, dst, group = step.input, step.output, step.group
        size = self.tp if group == "tp" else self.ep
        if self.comm is not None:
            rank = self.ranks[0].rank
            if not active[rank]:  # dp layout: an idle group's tp collectives are skipped by all its ranks
                return
            env = envs[rank]
            self._count(rank, step, env[src], size)
            if step.op == "AllReduce":
                env[dst] = self.comm.all_reduce(env[src], group)
            else:
                env[dst] = self.comm.all_gather(env[src], group, step.axis)
            return
        for start in range(0, self.world_size, size):
            members = range(start, start + size)
            if not active[members[0]]:
                continue
            for r in members:
                self._count(r, step, envs[r][src], size)
            if step.op == "AllReduce":
                total = envs[members[0]][src].copy()
                for r in members[1:]:
                    total += envs[r][src]
            else:
                total = np.concatenate([envs[r][src] for r in members], axis=step.axis)
            for r in members:
                envs[r][dst] = total

    def _all_to_all(self, step: CollectiveStep, envs: dict[int, dict], active: dict[int, bool]) -> None:
        """MoEDispatch / MoECombine over the ep group (= the world in the dp layout); idle ranks send nothing."""
        ins, outs = step.inputs, step.outputs
        if step.op == "MoEDispatch":
            def inputs(r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                if active[r]:
                    return tuple(envs[r][name] for name in ins)
                return (np.zeros((0, self.moe_dim), np.float32), np.zeros((0, self.top_k), np.int64),
                        np.zeros((0, self.top_k), np.float32))

            layer = self._moe_layer[outs[0]]
            for r in envs:
                self.step_expert_tokens[layer] += np.bincount(inputs(r)[1].ravel(), minlength=self.num_experts)
            if self.comm is not None:
                rank = self.ranks[0].rank
                results = {rank: all_to_all.mpi_dispatch(self.comm.groups["ep"], *inputs(rank), self.num_experts,
                                                         self.ranks[0].traffic)}
            else:
                order = sorted(envs)
                done = all_to_all.reference_dispatch(*zip(*(inputs(r) for r in order)), self.num_experts,
                                                     [r.traffic for r in self.ranks])
                results = dict(zip(order, done))
            for r, (recv_x, recv_ids, recv_w, lay) in results.items():
                envs[r].update(zip(outs, (recv_x, recv_ids, recv_w, lay.send_rows, lay.send_counts, lay.recv_counts)))
            return

        def layout(r: int) -> all_to_all.DispatchLayout:
            return all_to_all.DispatchLayout(*(envs[r][name] for name in ins[1:4]))

        def num_tokens(r: int) -> int:
            return envs[r][ins[4]].shape[0] if active[r] else 0

        if self.comm is not None:
            rank = self.ranks[0].rank
            envs[rank][outs[0]] = all_to_all.mpi_combine(self.comm.groups["ep"], envs[rank][ins[0]], layout(rank),
                                                         num_tokens(rank), self.ranks[0].traffic)
            return
        order = sorted(envs)
        combined = all_to_all.reference_combine([envs[r][ins[0]] for r in order], [layout(r) for r in order],
                                                [num_tokens(r) for r in order], [r.traffic for r in self.ranks])
        for r, y in zip(order, combined):
            envs[r][outs[0]] = y

    def _run(self, batches: dict[int, StepBatch | None]) -> dict[int, dict]:
        """One lockstep step of this process's ranks, each with its group's batch (None: idle); their envs."""
        for b in {id(b): b for b in batches.values() if b is not None}.values():
            check_step_batch(self, b)
        active = {r: b is not None for r, b in batches.items()}
        envs = {r.rank: {**self._feeds(batches[r.rank]), **r.pool_feeds} if active[r.rank] else {} for r in self.ranks}
        self.step_expert_tokens[:] = 0
        for step in self.ranks[0].steps:
            if isinstance(step, SegmentStep):
                for r in self.ranks:
                    if step.segment in r.expert_segments:
                        r.run_experts(step, envs[r.rank])
                    elif active[r.rank]:
                        r.run_segment(step, envs[r.rank])
            else:
                self._collective(step, envs, active)
        self.expert_tokens += self.step_expert_tokens
        grouped = self.comm is not None and self.dp_layout and self.tp > 1
        self.group_step_expert_tokens = self.comm.group_sum(self.step_expert_tokens) if grouped else self.step_expert_tokens
        for r in self.ranks:
            if active[r.rank]:
                r.write_back(envs[r.rank], batches[r.rank])
        return envs

    def _feeds(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """The batch's graph inputs; with a vision tower, no image rows when the batch carries none."""
        feeds = batch.feeds()
        if self.image_width is not None and "image_rows" not in feeds:
            feeds.update(image_rows=np.zeros(0, dtype=np.int64), image_embeds=np.zeros((0, self.image_width), np.float32))
        return feeds

    def encode_images(self, items: list) -> list[np.ndarray]:
        """Tower embeddings of images given as (pixel_values, grid). Under mpiexec every rank of an attention
        group that received the call encodes images i with i mod tp == its group rank, and the group's first
        rank gathers them all (world rank 0 returns them; the others' results are not used)."""
        from moe_export.runtime.engine.vision import encode_spread

        if self.vision is None:
            raise InputError(f"{self.dir}: this engine has no vision tower (text only)")
        return encode_spread(self.vision, items, None if self.comm is None or self.tp == 1 else self.comm.groups["tp"])

    def step(self, batch: StepBatch | None) -> np.ndarray | None:
        """Run one packed step; updates the state pools and returns logits [N, vocab] (fp32). dp layout: `batch`
        is this process's group's step (group 0 in one process, the others idle); None: an idle step, -> None."""
        if batch is None and not self.dp_layout:
            raise InputError("an idle step (no batch) exists only in the dp layout, where groups join the MoE "
                             "all-to-alls without tokens")
        if self.comm is None and self.dp_layout:
            return self.step_groups([batch] + [None] * (self.dp - 1))[0]
        envs = self._run({r.rank: batch for r in self.ranks})
        return None if batch is None else envs[self.ranks[0].rank]["logits"]

    def sample(self, batch: StepBatch | None, sampling: SamplingBatch | None) -> SampledTokens | None:
        """`ModelRunner.sample`: one step, then the batched sampler on the logits (CPU torch, no copy)."""
        logits = self.step(batch)
        return None if sampling is None or logits is None else choose_tokens(torch.from_numpy(logits), sampling)

    def step_groups(self, batches: list[StepBatch | None]) -> list[np.ndarray | None]:
        """dp layout in one process: one step of every attention group at once (None: that group idles);
        each group's logits [N_g, vocab] (None for an idle group)."""
        if self.comm is not None or not self.dp_layout:
            raise InputError("step_groups runs every attention group of a dp-layout engine in one process")
        if len(batches) != self.dp:
            raise InputError(f"the engine has {self.dp} attention groups, got {len(batches)} batches")
        envs = self._run({r.rank: batches[r.mapping.dp_rank] for r in self.ranks})
        return [None if b is None else envs[g * self.tp]["logits"] for g, b in enumerate(batches)]


"""TensorRT execution of a built engine directory (backend: tensorrt), behind the runtime's `Engine` interface.

NOT RUN ANYWHERE YET: no machine of this project has TensorRT (the lent GPU image has none either). Written
against TensorRT's public Python runtime API (>= 10.9); every TensorRT call's return value is checked (contract
SET_INPUT_SHAPE_RETURNS_BOOL, `plugins/tensorrt_contracts.py`). What is checked on CPU: the engine file, the
profile and pool-size rules, the return-value checks and the stream discipline (with stand-ins of the context
and of torch.cuda), the import guard.

As TensorRT-LLM runs its engines:
  - Placement: one process per GPU under `mpiexec -n world_size`; the local rank picks the GPU
    (`plugins.tensorrt_runtime.select_device`), at build and here.
  - One engine per rank (`rank{N}.engine`, see `export/backends/tensorrt/engine.py`) with its collectives inside as
    plugins; this runner registers the NCCL communicators they use (`plugins.collectives.nccl`: tp and ep
    groups of consecutive ranks, rendezvous from MPI) before deserializing it. A step is one enqueue.
  - Memory: the execution context is created with ExecutionContextAllocationStrategy.USER_MANAGED and given
    one activation buffer of the engine's `device_memory_size_v2` (contract USER_MANAGED_DEVICE_MEMORY), the
    size the planner set aside (the build refused anything larger).
  - Pools: the runner owns them, one torch allocation per pool ([S, ...] per KDA layer,
    paged [NB, BS, W] caches in the recipe's cache dtype; the list is the graph's metadata `pools`). They are
    not engine inputs or outputs: the engine gets one small input, the pool table [P, 3] int64 of their device
    addresses (`plugins/pool_table.py`, checked on the host when it is made), as TensorRT-LLM passes its
    attention plugin `host_kv_cache_pool_pointers` + `kv_cache_block_offsets`; the plugins write the step's
    rows / slots in place through it (the step's block tables and slot ids are the offsets, checked by
    `check_step_batch`). The pools never move, so the table is made once and the decode CUDA graphs replay
    with it.
  - Stream: one CUDA stream per rank for everything: pool allocation, slot resets, the step's
    host-to-device inputs, the enqueue (the plugins and the NCCL collectives run on it) and the logits copy
    back; the host waits once per step, for the logits.
  - Profiles: pools are sized within the limits the build recorded (`pool_limits`: num_slots <= its slots,
    cache blocks = its blocks unless fewer are asked), and every step's input shape is checked against the
    profile before TensorRT sees it (contract PROFILE_BOUNDS).
  - Wide EP (`parallel.attention: dp`): each attention group (tp consecutive ranks) runs its own requests with
    the engine core's per-group scheduling (`runtime/core/wide_ep.py`: the group's first rank schedules and
    broadcasts the plan in the group over MPI, rank 0 spreads requests over the groups), as the ONNX Runtime
    engine does; the engine's MoEDispatch / MoECombine plugins run NCCL all-to-alls over the world. Every rank
    runs one engine step per world step, a group with nothing to run an idle one (`step(None)`), and the ranks
    agree on the step's kind with one host all-reduce over MPI (`_agree_bucket`, no device wait): when every
    rank's step is a decode step (or idle), all run the largest decode bucket among them through its CUDA graph,
    their batches padded to it, and the all-to-alls move fixed blocks of ceil(bucket / tp) rows per peer with no
    host value (`plugins/collectives/all_to_all.py`); otherwise every rank runs eagerly and the all-to-alls use
    the counted transport (one read-back of the counts per MoE layer). This is also what NCCL asks of captured
    collectives: whether a launch is captured must be the same on every rank of the communicator, and a graph
    holding captured NCCL operations must be launched by every rank that captured it (NCCL user guide, "Using
    NCCL with CUDA Graphs"); captured and eager operations may be outstanding together. Warm-up captures each
    bucket on every rank in the same order. The real tokens of the rank's share are a
    device value set before each enqueue or replay (`Communicator.begin_step`), so padding rows, and the idle
    group's dummy rows, are routed nowhere; the rank still receives and computes what the others send its
    experts, and its expert op computes only the rows received (their count read on the device). The dispatches
    count the tokens routed to each expert on the device (`step_expert_tokens`, per MoE layer), copied back
    with the step's one wait.
  - CUDA graphs: decode steps (one token per sequence) run through a CUDA graph per batch-size bucket
    (`decode_buckets`: powers of two up to max_batch). Each bucket has its own execution context sharing the
    rank's one activation buffer (they never run concurrently: one stream), static input buffers and a fixed
    block-table width (the profile's max); the batch is padded to the bucket with rows on a spare slot
    (`pad_decode_feeds`; the profile admits max_batch + 1 slots) whose table rows are -1, so they write no cache
    row. A bucket's first step runs eagerly (the JIT plugins compile their kernels), then is captured; later
    steps copy their inputs into the static buffers and replay. Possible because no plugin synchronizes with
    the host inside its enqueue (in the dp layout: the block transport). Prefill and mixed steps run eagerly on
    the main context.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
from moe_export.common.engine_config import EngineConfig
from moe_export.common.engine_file import read_engine_meta, stream_reader
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.common.mpi import mpi_world
from moe_export.common.engine_file import VISION_ENGINE, rank_engine_name
from moe_export.graphs.onnx_export import POOL_TABLE, POOLS_KEY
from moe_export.plugins.pool_table import device_pool_table
from moe_export.runtime.engine.batch import (
    RESET_ON_NEW_SEQUENCE,
    StepBatch,
    check_checkpoint,
    check_slot,
    check_step_batch,
    checkpoint_interval,
)
from moe_export.runtime.engine.tensorrt_nccl import NcclGroups
from moe_export.runtime.engine.tensorrt_bind import bind
from moe_export.runtime.engine.torch_rows import PoolRows
from moe_export.runtime.engine.runner import StepRefused, choose_tokens, wait_for_step
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch


def pool_shapes(graph_path: Path, sizes: dict[str, int]) -> dict[str, tuple[list[int], int]]:
    """{pool: (shape with S / NB / BS resolved from `sizes`, ONNX element type)} of a TensorRT rank graph, in pool
    table row order (the graph's metadata `pools`)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if POOLS_KEY not in meta:
        raise InputError(f"{graph_path}: no pool list in the graph's metadata (engines built before the pool table "
                         "must be rebuilt)")
    return {p["name"]: ([sizes[d] if isinstance(d, str) else d for d in p["dims"]], p["elem_type"])
            for p in json.loads(meta[POOLS_KEY])}  # fmt: skip


def dispatch_layers(graph_path: Path) -> int:
    """MoE layers whose tokens go through an all-to-all dispatch (dp layout) in a rank graph."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    return sum(node.op_type == "MoEDispatch" for node in model.graph.node)


def runner_pool_sizes(meta: dict, max_batch: int, num_slots: int | None, num_blocks: int | None) -> tuple[int, int]:
    """(slots, cache blocks) the runner allocates, within the limits the build recorded (`pool_limits`: the
    planner's pool sizes, slots including the decode graphs' padding slot): slots default to max_batch, blocks
    to the build's (never recomputed from a smaller slot count, which would give more blocks than the build
    planned); either above the limits is an InputError."""
    limits = meta["pool_limits"]
    slots = num_slots or max_batch
    limit = min(max_batch, int(limits["slots"]))
    if slots > limit:
        raise InputError(f"num_slots={slots}: the engine allows at most {limit} state slots "
                         "(rebuild with a larger limits.max_batch)")
    nb_max = int(limits["blocks"])
    blocks = num_blocks or nb_max
    if blocks > nb_max:
        raise InputError(f"num_blocks={blocks}: the engine's build allows at most {nb_max} cache blocks")
    return slots, blocks


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes a decode CUDA graph is captured for: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def graph_buckets(num_slots: int, pad_slot: int | None) -> list[int]:
    """The decode CUDA graphs' buckets: none without a spare slot to pad onto."""
    return decode_buckets(num_slots) if pad_slot is not None else []


EAGER_STEP = 1 << 30  # a rank's bid in the world's bucket agreement when its step cannot replay a graph
REFUSED_STEP = EAGER_STEP + 1  # a rank's bid when its step failed validation: every rank refuses the step


def share_tokens(real: int, step_tokens: int, tp: int, tp_rank: int) -> int:
    """Real tokens in a tp rank's share of its group's step (the dispatch input: rows r*c .. of the step's
    tokens, c = ceil(step_tokens / tp), the first `real` of which are real; padding tokens follow)."""
    return max(0, real - tp_rank * -(-step_tokens // tp))


def is_decode(batch: StepBatch) -> bool:
    """Every sequence of the step contributes exactly one token."""
    return int(batch.input_ids.shape[0]) == batch.num_sequences


def pad_decode_feeds(batch: StepBatch, bucket: int, pad_slot: int, table_width: int) -> dict[str, np.ndarray]:
    """A decode step's inputs padded to `bucket` sequences and `table_width` table columns: pad rows have one
    token at position 0 on `pad_slot`, block-table rows of -1 (no cache row written, none read) and their own
    logits row; real rows keep their order, so logits[:N] are the step's."""
    n, width = batch.num_sequences, batch.block_tables.shape[1]
    if n > bucket or width > table_width:
        raise ValueError(f"decode step of {n} sequences x {width} table columns does not fit bucket {bucket} x "
                         f"{table_width}")
    ids = np.zeros(bucket, np.int64)
    ids[:n] = batch.input_ids
    pos = np.zeros(bucket, np.int64)
    pos[:n] = batch.positions
    slots = np.full(bucket, pad_slot, np.int64)
    slots[:n] = batch.slot_ids
    tables = np.full((bucket, table_width), -1, np.int64)
    tables[:n, :width] = batch.block_tables
    rows = np.arange(bucket + 1, dtype=np.int64)
    return {"input_ids": ids, "positions": pos, "cu_seqlens": rows, "slot_ids": slots, "block_tables": tables,
            "last_token_index": rows[:-1]}  # fmt: skip


class TensorRTEngine(PoolRows):
    """The `Engine` interface (RUNTIME_API.md section 1) over one TensorRT engine per rank, one rank per process."""

    def __init__(self, engine_dir: str | Path, *, num_slots: int | None = None, num_blocks: int | None = None,
                 threads: int | None = None, num_checkpoints: int | None = None):  # fmt: skip
        self.dir = Path(engine_dir)
        self.config = EngineConfig.read(self.dir)
        if self.config.backend != "tensorrt":
            raise InputError(f"{self.dir}: built for backend {self.config.backend!r}, not tensorrt")
        from moe_export.plugins.tensorrt_runtime import import_tensorrt, register_plugins, select_device

        trt = import_tensorrt(self.config.name)
        import torch

        if not torch.cuda.is_available():
            raise InputError("the TensorRT runtime needs a CUDA device")
        rank_dir = self._read_layout(num_slots, num_blocks)
        self.device = torch.device("cuda", select_device())  # local rank -> GPU
        self.stream = torch.cuda.Stream(self.device)  # every copy, reset and enqueue of this rank
        self._trt, self._torch = trt, torch
        register_plugins()  # the plugins' Python callbacks must exist before deserialization
        multi = self.world_size > 1 or self.dp_layout  # a dp graph holds all-to-alls even at world 1
        self.comm = NcclGroups(self.mapping) if multi else None
        num_experts = ModelConfig.from_hf_dict(self.model_config, source="engine config.json").num_experts
        # tokens routed to each expert per dispatching MoE layer (dp layout): the last step's, the running total,
        # and on a group's first rank the last step's of its whole attention group
        self.step_expert_tokens = np.zeros((dispatch_layers(rank_dir / "model.onnx"), num_experts), np.int64)
        self.expert_tokens = np.zeros_like(self.step_expert_tokens)
        self.group_step_expert_tokens = self.step_expert_tokens
        if self.dp_layout:
            self.comm.nccl["ep"].reserve(self.device, len(self.step_expert_tokens), num_experts)
            self._routed_host = torch.zeros(self.step_expert_tokens.shape, dtype=torch.int64, pin_memory=True)
        self._open_engine(rank_dir)
        self._allocate(rank_dir, num_checkpoints)
        self._start_vision_tower(trt, torch)
        self._warm_up()
        self.stream.synchronize()

    def _read_layout(self, num_slots: int | None, num_blocks: int | None) -> Path:
        """World, rank, layout, this rank's engine metadata and pool sizes; returns the rank's folder."""
        limits = self.config.limits
        self.model_config: dict = self.config.pretrained_config
        self.world_size = self.config.mapping.world_size
        self.tp, self.ep = self.config.mapping.tp, self.config.mapping.ep
        self.dp_layout = self.config.mapping.all_to_all
        self.dp = self.config.mapping.dp  # attention groups with their own batches
        world = mpi_world() or (0, 1)
        if world[1] != self.world_size:
            raise InputError(f"{self.dir}: engine has {self.world_size} ranks; run it under mpiexec -n {self.world_size}")
        self.rank = world[0]
        self.mapping = self.config.rank_mapping(self.rank)
        self.group = self.mapping.dp_rank
        rank_dir = self.dir / f"rank{self.rank}"
        self._engine_file = rank_dir / rank_engine_name(self.rank)
        self.meta, self._plan_offset, self._plan_size = read_engine_meta(self._engine_file)
        self.num_slots, self.num_blocks = runner_pool_sizes(self.meta, limits.max_batch, num_slots, num_blocks)
        self.max_seq_len = limits.max_seq_len
        self.max_num_tokens = limits.max_num_tokens
        self.max_step_pairs = None  # the plugins stream over the context (online softmax): no [T, context] rows
        self.block_size = limits.block_size
        # decode CUDA graphs pad batches onto one spare slot (the build's limits admit max_batch + 1 slots)
        self._pad_slot = self.num_slots if int(self.meta["pool_limits"]["slots"]) > self.num_slots else None
        self._graphs: dict[int, _DecodeGraph] = {}
        self._buckets = graph_buckets(self.num_slots, self._pad_slot)
        return rank_dir

    def _open_engine(self, rank_dir: Path) -> None:
        """The engine, streamed from its file in chunks (contract ENGINE_STREAMS: no host copy of the whole plan),
        and its USER_MANAGED main context."""
        trt = self._trt
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        reader = stream_reader(trt, self._engine_file, self._plan_offset, self._plan_size)
        self._engine = self._runtime.deserialize_cuda_engine(reader)
        if self._engine is None:
            raise InputError(f"{rank_dir}: TensorRT could not deserialize the engine (version or GPU mismatch?)")
        self._context = self._engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if self._context is None:
            raise RuntimeError("TensorRT could not create an execution context")

    def _allocate(self, rank_dir: Path, num_checkpoints: int | None) -> None:
        """On the rank's stream: the one activation buffer, the pools (one allocation each, in pool table row
        order), their checked pool table and the host checkpoints of the recurrent state."""
        torch = self._torch
        size = int(self._engine.device_memory_size_v2)
        with torch.cuda.stream(self.stream):
            self._activations = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)  # one per rank
            self._empty = torch.empty(256, dtype=torch.uint8, device=self.device)  # the address of empty inputs
            slots = self.num_slots + (self._pad_slot is not None)
            sizes = {"S": slots, "NB": self.num_blocks, "BS": self.block_size}
            self.pools = {
                name: torch.zeros(shape, dtype=self._torch_dtype_onnx(elem), device=self.device)
                for name, (shape, elem) in pool_shapes(rank_dir / "model.onnx", sizes).items()
            }
            # the pools' addresses, checked (null / misaligned / check word: PoolTableError) before any launch
            # (made by device_pool_table: plugin callbacks in this process can reach the pool tensors, fla's KDA)
            self.pool_table = {POOL_TABLE: device_pool_table(list(self.pools.values()))} if self.pools else {}
            # prefix-caching state checkpoints in pinned host memory (GPU memory stays the planner's pools): a
            # save / restore is one async copy of a slot's rows on this rank's stream, ordered with the steps
            self.num_checkpoints = (self.config.limits.checkpoints_per_slot * self.num_slots if num_checkpoints is None
                                    else num_checkpoints)
            self.checkpoints = {name: torch.zeros((self.num_checkpoints, *pool.shape[1:]), dtype=pool.dtype, pin_memory=True)
                                for name, pool in self.pools.items() if name.startswith(RESET_ON_NEW_SEQUENCE)}
        self.checkpoint_interval = checkpoint_interval(
            {name: (tuple(pool.shape), pool.element_size()) for name, pool in self.pools.items()}, self.block_size,
            self.max_num_tokens)
        self._context.set_device_memory(self._activations.data_ptr(), size)
        self._activation_size = size

    def _warm_up(self) -> None:
        """Before the first request: the NCCL communicators made (`NcclGroups.warm_up`: one small collective
        per group) and the plugin kernels compiled, by steps on the spare slot (block-table rows -1: no cache row
        written): one eager step of one token (in the dp layout the idle step, which every rank runs here in the
        same order), then every decode bucket's first step and CUDA graph capture. Without a spare slot (the
        profile admits none) the kernels compile at the first request."""
        if self.comm is not None:
            self.comm.warm_up(self._torch, self.device)
        if self._pad_slot is None:
            return
        if self.dp_layout:
            self._idle_enqueue()
        else:
            self._enqueue(self._with_images(pad_decode_feeds(_empty_decode(), 1, self._pad_slot, 1)))
        for bucket in self._buckets:
            self._bucket_step(bucket, _empty_decode())

    def _start_vision_tower(self, trt, torch) -> None:
        """K3: the replicated tower engine (`vision.engine`, `runtime.engine.tensorrt_vision`) and the MPI
        communicator of this rank's attention group its images are spread over; `vision` None without one."""
        self.media_pad_id = self.model_config.get("media_placeholder_token_id")
        self.vision, self._image_group, self.image_width = None, None, None
        if not (self.dir / VISION_ENGINE).is_file():
            return
        from moe_export.runtime.engine.tensorrt_vision import TensorRTTower
        from moe_export.runtime.engine.vision import VisionEncoder

        tower = TensorRTTower(self.dir / VISION_ENGINE, self._runtime, trt, torch, self.device, self.stream)
        self.vision = VisionEncoder(self.dir, self.config, 0, tower=tower)
        self.image_width = self.vision.vc.text_hidden_size  # the step's image_embeds rows
        if self.world_size > 1 and self.tp > 1:
            self._image_group = self.comm.groups["tp"]

    def encode_images(self, items: list) -> list[np.ndarray]:
        """Tower embeddings of images given as (pixel_values, grid), spread over this rank's attention group
        (`runtime.engine.vision.encode_spread`; the group's first rank returns them all)."""
        from moe_export.runtime.engine.vision import encode_spread

        if self.vision is None:
            raise InputError(f"{self.dir}: this engine has no vision tower engine (text only, or built before "
                             "the TensorRT tower: rebuild)")
        return encode_spread(self.vision, items, self._image_group)

    # ---- Engine interface ----
    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def reset_slot(self, slot: int) -> None:
        check_slot(self, slot)
        with self._torch.cuda.stream(self.stream):
            for name, pool in self.pools.items():
                if name.startswith(RESET_ON_NEW_SEQUENCE):
                    pool[slot].zero_()

    def save_state(self, slot: int, checkpoint: int) -> None:
        check_checkpoint(self, slot, checkpoint)
        with self._torch.cuda.stream(self.stream):
            for name, rows in self.checkpoints.items():
                rows[checkpoint].copy_(self.pools[name][slot], non_blocking=True)

    def restore_state(self, slot: int, checkpoint: int) -> None:
        check_checkpoint(self, slot, checkpoint)
        with self._torch.cuda.stream(self.stream):
            for name, rows in self.checkpoints.items():
                self.pools[name][slot].copy_(rows[checkpoint], non_blocking=True)

    # ---- `OffloadRunner` (`torch_rows.PoolRows`): raw rows for the offload store, on this rank's stream ----
    def rank_pools(self) -> dict:
        return {self.rank: self.pools}

    def rank_checkpoints(self) -> dict:
        return {self.rank: self.checkpoints}

    @contextlib.contextmanager
    def pool_stream(self, wait: bool):
        with self._torch.cuda.stream(self.stream):
            if wait:
                self.stream.synchronize()
            yield

    def _feeds(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """The batch's inputs; a K3 text graph's image rows are empty when the step carries none."""
        return self._with_images(batch.feeds())

    def _with_images(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`feeds` with empty image rows where the graph has them (see `_feeds`)."""
        profile = self.meta["profile"]
        if "image_rows" in profile and "image_rows" not in feeds:
            width = profile["image_embeds"][0][1]
            feeds.update(image_rows=np.zeros(0, np.int64), image_embeds=np.zeros((0, width), np.float32))
        return feeds

    def step(self, batch: StepBatch | None) -> np.ndarray | None:
        """Run one packed step on this rank; returns logits [N, vocab] fp32 (every rank). dp layout: None is an
        idle step of this rank's attention group (-> None)."""
        if batch is None:
            self._idle_step()
            return None
        with self._torch.cuda.stream(self.stream):
            logits = self._forward(batch).float().to("cpu", non_blocking=True)
            self._routed_to_host()
        self.stream.synchronize()  # the one wait of a step: the host needs the logits
        self._count_experts()
        return logits.numpy()

    def sample(self, batch: StepBatch | None, sampling: SamplingBatch | None) -> SampledTokens | None:
        """One step, then the batched sampler on the GPU on the step's stream: the logits stay on the device,
        only the chosen ids (and asked-for logprobs) are copied back (the wait of the step). None on
        follower ranks, which wait for the step only, and for an idle step (batch None, dp layout)."""
        if batch is None:
            self._idle_step()
            return None
        with self._torch.cuda.stream(self.stream):
            logits = self._forward(batch)
            self._routed_to_host()
            out = choose_tokens(logits, sampling) if sampling is not None else None
        if out is None or self.dp_layout:  # the dp layout's counts are read now: the step's one wait
            wait_for_step(out, self.stream.synchronize)
        self._count_experts()
        return out

    def _idle_step(self) -> None:
        """dp layout: join this step's MoE all-to-alls without tokens (see the module doc): the world's decode
        bucket with no real row, or one eager dummy token on the spare slot, the dispatch sending none of its rows."""
        if not self.dp_layout:
            raise InputError("an idle step (no batch) exists only in the dp layout, where groups join the MoE "
                             "all-to-alls without tokens")
        if self._pad_slot is None:
            raise InputError(f"num_slots={self.num_slots}: an idle step needs the spare state slot the profile "
                             "admits beyond the runner's slots; open the engine with fewer slots")
        bucket = self._agree_bucket(self._buckets[0] if self._buckets else EAGER_STEP)
        with self._torch.cuda.stream(self.stream):
            if bucket is None:
                self._idle_enqueue()
            else:
                self._bucket_step(bucket, _empty_decode())
            self._routed_to_host()
        self.stream.synchronize()
        self._count_experts()

    def _idle_enqueue(self) -> None:
        """Enqueue an eager idle step: one dummy token on the spare slot, none of it real."""
        with self._torch.cuda.stream(self.stream):
            for name, pool in self.pools.items():
                if name.startswith(RESET_ON_NEW_SEQUENCE):
                    pool[self._pad_slot].zero_()
            self.comm.nccl["ep"].begin_step(0, 0)
            self._enqueue(self._with_images(pad_decode_feeds(_empty_decode(), 1, self._pad_slot, 1)))

    def _agree_bucket(self, bid: int, refusal: InputError | None = None) -> int | None:
        """The world step's decode bucket from this rank's `bid` (its own bucket, or EAGER_STEP): in the dp layout
        every rank runs the largest bid (one host all-reduce over MPI, no device wait), and if any rank's step is
        eager every rank's is (the all-to-alls' transport must be the same on every rank); None: an eager step.
        A rank whose step failed validation (`refusal`) bids REFUSED_STEP: then every rank raises StepRefused (the
        verdict is agreed before any collective, so no rank waits for one that left)."""
        if self.dp_layout:
            from mpi4py import MPI

            bid = self.comm.world.allreduce(bid, op=MPI.MAX)
        if bid >= REFUSED_STEP:
            raise StepRefused(f"the step failed validation: {refusal}" if refusal is not None
                              else "another rank's step failed validation: every rank refused the world step")
        return None if bid >= EAGER_STEP else bid

    def _begin_moe_step(self, real: int, step_tokens: int, block_rows: int) -> None:
        """dp layout: the ep communicator's state for the next enqueue or replay (see `share_tokens`)."""
        if self.dp_layout:
            valid = share_tokens(real, step_tokens, self.tp, self.mapping.tp_rank)
            self.comm.nccl["ep"].begin_step(valid, block_rows)

    def _routed_to_host(self) -> None:
        """dp layout: the step's per-expert token counts copied back on the stream (read after its one wait)."""
        if self.dp_layout:
            self._routed_host.copy_(self.comm.nccl["ep"].routed, non_blocking=True)

    def _count_experts(self) -> None:
        """The step's per-expert token counts from the dispatch plugins (dp layout; nothing otherwise)."""
        if not self.dp_layout:
            return
        self.step_expert_tokens = self._routed_host.numpy().copy()
        self.expert_tokens += self.step_expert_tokens
        self.group_step_expert_tokens = (self.comm.group_sum(self.step_expert_tokens) if self.tp > 1
                                         else self.step_expert_tokens)

    def _forward(self, batch: StepBatch):
        """Enqueue one packed step on `self.stream`: its logits [N, vocab] on the device (not waited for). Decode
        steps replay their bucket's CUDA graph (in the dp layout the world's bucket, see `_agree_bucket`)."""
        try:
            check_step_batch(self, batch)
        except InputError as exc:
            self._agree_bucket(REFUSED_STEP, exc)  # raises StepRefused here and on every other rank
        n = batch.num_sequences
        fits = is_decode(batch) and self._buckets and n <= self._buckets[-1]
        bucket = self._agree_bucket(next(b for b in self._buckets if b >= n) if fits else EAGER_STEP)
        if bucket is not None:
            return self._bucket_step(bucket, batch)
        tokens = int(batch.input_ids.shape[0])
        self._begin_moe_step(tokens, tokens, 0)
        return self._enqueue(self._feeds(batch))

    def _enqueue(self, feeds: dict[str, np.ndarray]):
        """Bind `feeds`, the pool table and fresh outputs to the main context and enqueue it on `self.stream`: the
        logits on the device (not waited for)."""
        torch = self._torch
        with torch.cuda.stream(self.stream):
            inputs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device, non_blocking=True)
                      for k, v in feeds.items() if k in self.meta["profile"]}  # fmt: skip
            inputs.update(self.pool_table)
            outputs = {}
            bind(self._context, self.meta, inputs, outputs, self._empty.data_ptr())
            for name in self.meta["outputs"]:
                shape = tuple(self._context.get_tensor_shape(name))
                dtype = self._torch_dtype(self._engine.get_tensor_dtype(name))
                outputs[name] = torch.empty(shape, dtype=dtype, device=self.device)
                if not self._context.set_tensor_address(name, outputs[name].data_ptr()):
                    raise RuntimeError(f"TensorRT refused the address of output {name}")
            if not self._context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT failed to enqueue the step (see the log above)")
        return outputs["logits"]

    # ---- internals ----
    def _bucket_step(self, bucket: int, batch: StepBatch):
        """`batch` padded to `bucket` through the bucket's graph (eager and captured the first time)."""
        torch = self._torch
        n = batch.num_sequences
        graph = self._graphs.get(bucket) or self._new_graph(bucket)
        feeds = self._with_images(pad_decode_feeds(batch, bucket, self._pad_slot, graph.table_width))
        with torch.cuda.stream(self.stream):
            for name, buf in graph.inputs.items():
                buf.copy_(torch.from_numpy(feeds[name]), non_blocking=True)
            for name, pool in self.pools.items():
                if name.startswith(RESET_ON_NEW_SEQUENCE):
                    pool[self._pad_slot].zero_()  # padding rows start from a clean state every step
            block = -(-bucket // self.tp) if self.dp_layout else 0  # dp: blocks hold a share of the bucket
            self._begin_moe_step(n, bucket, block)
            if graph.cuda_graph is None:  # first step of the bucket: run it, then capture it
                if not graph.context.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError("TensorRT failed to enqueue the step (see the log above)")
                self._begin_moe_step(n, bucket, block)  # the capture's dispatches count layers from the first
                cuda_graph = torch.cuda.CUDAGraph()
                # thread-local capture (as TensorRT-LLM's runtime): CUDA calls of the engine core's other threads
                # while this one captures (host copies, allocations) are theirs, not errors that void the capture
                with torch.cuda.graph(cuda_graph, stream=self.stream, capture_error_mode="thread_local"):
                    if not graph.context.execute_async_v3(self.stream.cuda_stream):
                        raise RuntimeError("TensorRT failed to enqueue the step while capturing a CUDA graph")
                graph.cuda_graph = cuda_graph
            else:
                graph.cuda_graph.replay()
        return graph.logits[:n]

    def _new_graph(self, bucket: int) -> _DecodeGraph:
        """The bucket's context (sharing the activation buffer), static inputs and outputs, bound once."""
        torch, trt = self._torch, self._trt
        context = self._engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise RuntimeError("TensorRT could not create an execution context")
        context.set_device_memory(self._activations.data_ptr(), self._activation_size)
        width = self.meta["profile"]["block_tables"][2][1] if "block_tables" in self.meta["profile"] else 1
        feeds = self._with_images(pad_decode_feeds(_empty_decode(), bucket, self._pad_slot, width))
        with torch.cuda.stream(self.stream):
            inputs = {k: torch.from_numpy(v).to(self.device) for k, v in feeds.items() if k in self.meta["profile"]}
            bind(context, self.meta, {**inputs, **self.pool_table}, {}, self._empty.data_ptr())
            shape = tuple(context.get_tensor_shape("logits"))
            logits = torch.empty(shape, dtype=self._torch_dtype(self._engine.get_tensor_dtype("logits")),
                                 device=self.device)  # fmt: skip
            if not context.set_tensor_address("logits", logits.data_ptr()):
                raise RuntimeError("TensorRT refused the address of output logits")
        graph = self._graphs[bucket] = _DecodeGraph(context, inputs, logits, width)
        return graph

    def _torch_dtype(self, dtype):
        trt, torch = self._trt, self._torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int64: torch.int64, trt.int32: torch.int32, trt.uint8: torch.uint8, trt.bool: torch.bool}[dtype]  # fmt: skip

    def _torch_dtype_onnx(self, elem: int):
        from onnx import TensorProto

        torch = self._torch
        return {TensorProto.FLOAT: torch.float32, TensorProto.BFLOAT16: torch.bfloat16,
                TensorProto.FLOAT16: torch.float16, TensorProto.UINT8: torch.uint8}[elem]  # fmt: skip


def _empty_decode() -> StepBatch:
    """A decode step of no sequence (the static buffers of a bucket start as all padding)."""
    empty = np.zeros(0, np.int64)
    return StepBatch(empty, empty, np.zeros(1, np.int64), empty, np.zeros((0, 1), np.int64))


class _DecodeGraph:
    """One batch-size bucket: its execution context, static input buffers, logits buffer, captured graph."""

    def __init__(self, context, inputs: dict, logits, table_width: int):
        self.context, self.inputs, self.logits, self.table_width = context, inputs, logits, table_width
        self.cuda_graph = None

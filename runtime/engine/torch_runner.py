"""The torch runner (`backend: torch`): each rank's converted weights run by PyTorch with the plugins' kernels.

Per rank a `torch_model.RankModel` over `rank{N}/weights.safetensors` and the rank's pools, owned here and updated
in place: recurrent state by slot (`kda_state.i` [S, H, V, K] fp32, `conv_state.i` [S, 3P, W-1] fp32), paged caches
by block (`mla_cache.i`, `index_cache.i` [NB, BS, D] in the recipe's kv_cache dtype); prefix-cache checkpoints are
copies of a slot's recurrent rows, in host memory as the planner counts them (pinned on a GPU: `host_zeros`). The
device is the recipe's target: CPU for `gpu: cpu` (fp32 activations, the plugins' CPU kernels: the ONNX Runtime
engine's arithmetic, so greedy tokens match it), else the rank's GPU (bf16 activations, the plugins' Triton kernels,
decode steps replayed from CUDA graphs: `torch_graphs`), made the current device of every thread that launches
(`use_device`). The routed experts' MXFP4 bytes are put once at load in the layout the kernel table reads
(`RankModel.use_expert_layout`: standard for the CPU kernels, as the torch backend's convert writes them; the
W4A16 Triton kernel's on GPUs).

Worlds as in the ONNX Runtime runner: under `mpiexec -n R` this process is one rank (collectives over
torch.distributed, step plans over MPI: `ranks.MPICommunicator`, so `runtime/core` runs unchanged); in one process
every rank runs here in lockstep. In the dp layout `step(batch)` is this rank's group's step and `step(None)` an
idle one; in one process `step_groups` takes one batch (or None) per attention group.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.common.mpi import local_rank, mpi_world
from moe_export.graphs.vision_export import VISION_WEIGHTS
from moe_export.quantize import fp8_cache
from moe_export.runtime.engine.batch import (RESET_ON_NEW_SEQUENCE, StepBatch, check_checkpoint,
                                            check_slot, check_step_batch, checkpoint_interval)
from moe_export.runtime.engine.ranks import MPICommunicator, rank_folders
from moe_export.runtime.engine.runner import choose_tokens, wait_for_step
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch
from moe_export.runtime.engine.torch_collectives import DistributedWorld, run_in_process
from moe_export.runtime.engine.tensorrt import is_decode, share_tokens
from moe_export.runtime.engine.torch_graphs import EAGER_STEP, DecodeGraphs, buckets
from moe_export.runtime.engine.torch_kernels import CUDAKernels, kernels_for
from moe_export.runtime.engine.torch_model import RankModel, RankWeights, StepInputs
from moe_export.runtime.engine.torch_rows import PoolRows

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}  # fp8: codes + a scale byte
HOST_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.uint8: np.uint8}  # bf16: the same 2 bytes


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU from numpy's calloc, so pages stay unmapped until a step writes them (a pool sized
    for the recipe's memory costs only what sequences use, as the ONNX Runtime runner's numpy pools)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    host = torch.from_numpy(np.zeros(shape, dtype=HOST_DTYPES[dtype]))
    return host.view(dtype)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host buffer that `device` copies to and from: pinned (page-locked, so the copies are asynchronous
    DMA) for a GPU, a `zeros` pool for CPU. Prefix-cache checkpoints live here, as the planner counts them."""
    if device.type == "cuda":
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return zeros(shape, dtype, device)


def rank_pools(model: RankModel, num_slots: int, num_blocks: int, block_size: int) -> dict[str, torch.Tensor]:
    """A rank's zeroed pools on its device (names and layouts as the ONNX Runtime graphs' pool inputs)."""
    cfg, local, dev = model.cfg, model.local, model.device
    pools = {}
    for i in range(cfg.num_layers):
        if cfg.is_kda(i):
            heads, dh = local.kda_num_heads, cfg.kda_head_dim
            pools[f"kda_state.{i}"] = zeros((num_slots, heads, dh, dh), torch.float32, dev)
            pools[f"conv_state.{i}"] = zeros((num_slots, 3 * heads * dh, cfg.conv_kernel_size - 1), torch.float32, dev)
            continue
        extra = fp8_cache.SCALE_BYTES if model.cache_dtype == torch.uint8 else 0
        pools[f"mla_cache.{i}"] = zeros((num_blocks, block_size, cfg.latent_cache_dim + extra), model.cache_dtype, dev)
        if model.use_indexer and cfg.has_indexer(i):
            pools[f"index_cache.{i}"] = zeros((num_blocks, block_size, cfg.index_head_dim + extra), model.cache_dtype,
                                              dev)
    return pools


class TorchEngine(PoolRows):
    """A `backend: torch` engine directory with the ranks this process runs (all of them, or its MPI rank).
    Arguments as `ort.Engine`'s; `device` overrides the recipe's target (e.g. "cpu" on a GPU machine);
    `cuda_graphs`: replay decode steps from CUDA graphs on a GPU (`torch_graphs`; off: every step eager)."""

    def __init__(self, engine_dir: str | Path, *, num_slots: int | None = None, num_blocks: int | None = None,
                 threads: int | None = None, max_step_pairs: int | None = None, num_checkpoints: int | None = None,
                 device: str | None = None, cuda_graphs: bool = True) -> None:
        self.dir = Path(engine_dir)
        self.config = EngineConfig.read(self.dir)
        recipe, cfg = self.config.recipe, self.config.model
        rank_dirs = rank_folders(self.dir)
        self.world_size = len(rank_dirs)
        limits = recipe.limits
        self.num_slots = num_slots or limits.max_batch
        self.max_seq_len, self.max_num_tokens, self.block_size = limits.max_seq_len, limits.max_num_tokens, limits.block_size
        if num_checkpoints is not None and num_checkpoints < 0:
            raise InputError(f"num_checkpoints must be at least 0, got {num_checkpoints}")
        self.num_checkpoints = limits.checkpoints_per_slot * self.num_slots if num_checkpoints is None else num_checkpoints
        self.num_blocks = num_blocks or self.config.memory.pool_sizes(self.block_size, self.num_slots,
                                                                      self.num_checkpoints).num_blocks
        if self.num_blocks < 1:
            raise InputError(f"{self.dir}: no memory left for cache blocks with {self.num_slots} slots "
                             "(see `moe-export plan`); pass fewer slots or num_blocks")
        mpi = mpi_world()
        under_mpi = mpi is not None and mpi[1] > 1
        if under_mpi and mpi[1] != self.world_size:
            raise InputError(f"{self.dir}: engine has {self.world_size} ranks but mpiexec started {mpi[1]} processes")
        local = [mpi[0]] if under_mpi else list(range(self.world_size))
        self.device = torch.device(device or ("cpu" if recipe.target.gpu == "cpu" else
                                              f"cuda:{local_rank() if under_mpi else 0}"))
        self.use_device()
        if self.device.type == "cpu" and (threads or under_mpi):
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // mpi[1]))
        if max_step_pairs is not None and max_step_pairs < 1:
            raise InputError(f"max_step_pairs must be at least 1, got {max_step_pairs}")
        self.max_step_pairs = max_step_pairs  # the CPU kernels bound their temporaries by token chunks
        act = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        m = self.config.mapping
        self.tp, self.ep, self.dp_layout = m.tp, m.ep, m.all_to_all
        self.dp = self.world_size // self.tp if self.dp_layout else 1
        self.models = {r: RankModel(cfg, self.config.rank_mapping(r),
                                    RankWeights(rank_dirs[r] / "weights.safetensors", self.device, act), self.device, act,
                                    use_indexer=recipe.attention.indexer == "auto",
                                    topk=recipe.attention.sparse_topk or cfg.index_topk or 0,
                                    cache_dtype=CACHE_DTYPES[recipe.quantization.kv_cache]) for r in local}
        graphs = cuda_graphs and self.device.type == "cuda"
        spare = 1 if graphs else 0  # a slot and a block for the decode graphs' padding rows
        self.pools = {r: rank_pools(mod, self.num_slots + spare, self.num_blocks + spare, self.block_size)
                      for r, mod in self.models.items()}
        self.kernels = {r: kernels_for(self.device, list(p.values())) for r, p in self.pools.items()}
        for r, model in self.models.items():
            model.use_expert_layout(self.kernels[r].expert_layout)  # converted at most once, here
        self.checkpoints = {r: {n: host_zeros((self.num_checkpoints, *p.shape[1:]), p.dtype, self.device)
                                for n, p in pools.items() if n.startswith(RESET_ON_NEW_SEQUENCE)}
                            for r, pools in self.pools.items()}
        self.rank = local[0]  # this process's first rank (its only one under mpiexec)
        first = self.pools[local[0]]
        self.checkpoint_interval = checkpoint_interval(
            {n: (tuple(p.shape), p.element_size()) for n, p in first.items()}, self.block_size, self.max_num_tokens)
        self.comm, self.world = None, None
        if under_mpi:
            self.comm = MPICommunicator(self.config.rank_mapping(mpi[0]))
            self.world = DistributedWorld(self.config.rank_mapping(mpi[0]), self.device)
        self.model_config: dict = self.config.pretrained_config
        self.num_experts = cfg.num_experts
        moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers)) if self.dp_layout else 0
        self.step_expert_tokens = np.zeros((moe_layers, self.num_experts), dtype=np.int64)
        self.expert_tokens = np.zeros_like(self.step_expert_tokens)
        self.group_step_expert_tokens = self.step_expert_tokens
        self.counts_pending = False  # a device-transport step's counts copied back, not read yet (`finish_step`)
        self.vision = self._vision(threads)
        self.image_width = cfg.hidden_size if self.vision is not None else None
        self.media_pad_id = self.model_config.get("media_placeholder_token_id")
        self.graphs = None
        if graphs:
            self.graphs = DecodeGraphs.for_engine(self)

    def use_device(self) -> None:
        """Make the engine's GPU the calling thread's current device (`torch.cuda.set_device`, as vLLM's
        `Worker.init_device`): Triton kernels and CUDA graphs launch on the current device, which is per thread
        (device 0 in a new thread, e.g. the step worker's). Every entry point that launches calls it first."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def is_root(self) -> bool:
        return self.comm is None or self.comm.world.Get_rank() == 0

    @property
    def group(self) -> int:
        """This process's attention group (dp layout under mpiexec; 0 otherwise)."""
        return next(iter(self.models)) // self.tp if self.dp_layout and self.comm is not None else 0

    def _vision(self, threads: int | None):
        """K3's tower (`vision.VisionEncoder`) run by PyTorch (`torch_vision`), when the engine has one."""
        if not (self.dir / VISION_WEIGHTS).is_file():
            return None
        from moe_export.runtime.engine.torch_vision import TorchTower
        from moe_export.runtime.engine.vision import VisionEncoder

        tower = TorchTower(self.dir / VISION_WEIGHTS, self.config, self.device)
        return VisionEncoder(self.dir, self.config, threads or 1, tower=tower)

    # ---- slots and checkpoints ----
    def reset_slot(self, slot: int) -> None:
        """Start a new sequence in `slot`: zero its recurrent state."""
        check_slot(self, slot)
        self.use_device()
        for pools in self.pools.values():
            for name, pool in pools.items():
                if name.startswith(RESET_ON_NEW_SEQUENCE):
                    pool[slot] = 0

    def save_state(self, slot: int, checkpoint: int) -> None:
        """`ModelRunner.save_state`: the slot's recurrent rows into the checkpoint, on every local rank (an
        asynchronous copy into pinned host memory on a GPU, in stream order with the steps)."""
        check_checkpoint(self, slot, checkpoint)
        self.use_device()
        for r, rows in self.checkpoints.items():
            for name, saved in rows.items():
                saved[checkpoint].copy_(self.pools[r][name][slot], non_blocking=True)

    def restore_state(self, slot: int, checkpoint: int) -> None:
        """`ModelRunner.restore_state`: the checkpoint into the slot's recurrent rows, on every local rank."""
        check_checkpoint(self, slot, checkpoint)
        self.use_device()
        for r, rows in self.checkpoints.items():
            for name, saved in rows.items():
                self.pools[r][name][slot].copy_(saved[checkpoint], non_blocking=True)

    # ---- `OffloadRunner` (`torch_rows.PoolRows`): raw rows for the offload store ----
    def rank_pools(self) -> dict:
        return self.pools

    def rank_checkpoints(self) -> dict:
        return self.checkpoints

    @contextlib.contextmanager
    def pool_stream(self, wait: bool):
        self.use_device()
        if wait and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the steps and checkpoint copies queued before
        yield

    # ---- steps ----
    def inputs(self, batch: StepBatch) -> StepInputs:
        """The batch as device tensors (one host-to-device copy each)."""
        def dev(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

        return StepInputs(dev(batch.input_ids), dev(batch.positions), dev(batch.cu_seqlens), dev(batch.slot_ids),
                          dev(batch.block_tables), dev(batch.cu_seqlens[1:] - 1), dev(batch.image_rows),
                          dev(batch.image_embeds))

    def _run(self, batches: dict[int, StepBatch | None]) -> dict[int, torch.Tensor | None]:
        """One step of this process's ranks, each with its group's batch (None: idle); their logits."""
        for b in {id(b): b for b in batches.values() if b is not None}.values():
            check_step_batch(self, b)
        counts: list[np.ndarray] = []
        inputs = {id(b): self.inputs(b) for b in batches.values() if b is not None}
        steps = {r: (self.models[r].step(inputs[id(b)], self.pools[r], self.kernels[r]) if b is not None
                     else self.models[r].idle_step(self.kernels[r])) for r, b in batches.items()}
        with torch.no_grad():
            if self.world is not None:
                (r, step), = steps.items()
                results = {r: self.world.run(step, self.num_experts, counts)}
            else:
                results = run_in_process(steps, self.tp, self.ep, self.num_experts, counts)
        if self.dp_layout and counts:
            self._count_experts(np.stack(counts))
        return results

    def _count_experts(self, step_counts: np.ndarray) -> None:
        """The step's tokens routed to each expert [MoE layers, E] (dp layout), summed over the group."""
        self.step_expert_tokens[:] = step_counts
        self.expert_tokens += self.step_expert_tokens
        grouped = self.comm is not None and self.tp > 1
        self.group_step_expert_tokens = (self.comm.group_sum(self.step_expert_tokens) if grouped
                                         else self.step_expert_tokens)

    # ---- the dp layout's MoE all-to-alls on the device (under mpiexec, with the Triton kernels) ----
    def device_transport(self) -> bool:
        """Whether this rank's MoE all-to-alls run on the device (`DistributedWorld.use_device_transport`): the dp
        layout under mpiexec with the Triton kernel table (CUDA, or Triton's interpreter). Reserved on first use:
        receive buffers for the largest of the planner's bound and the decode buckets' blocks."""
        if not (self.dp_layout and self.world is not None and isinstance(self.kernels[self.rank], CUDAKernels)):
            return False
        if self.world.ep_comm is None:
            model = self.models[self.rank]
            rows = max(self.max_num_tokens, buckets(self.num_slots)[-1])
            self.world.use_device_transport(len(self.step_expert_tokens), self.num_experts,
                                            self.ep * -(-rows // self.tp), model.moe_dim,
                                            self.config.model.num_experts_per_token, model.act)
            self.routed_host = torch.zeros(self.step_expert_tokens.shape, dtype=torch.int64,
                                           pin_memory=self.device.type == "cuda")
        return True

    def agree_rows(self, batch: StepBatch | None) -> int:
        """The world's MoE transport for this step, agreed over MPI (host values only; every rank calls it, idle
        ones too): the most rows any rank's step dispatches from (its decode graph's bucket, or its tokens in an
        eager decode step; 0 idle), or EAGER_STEP when any rank's step is not a decode step (then every rank
        counts)."""
        from mpi4py import MPI

        if batch is None:
            rows = self.graphs.smallest if self.graphs is not None else 0
        elif self.graphs is not None and self.graphs.covers(batch):
            rows = self.graphs.bucket(batch.num_sequences)
        else:
            rows = batch.num_sequences if is_decode(batch) and self.graphs is None else EAGER_STEP
        return self.comm.world.allreduce(rows, op=MPI.MAX)

    def begin_moe_step(self, real: int, step_tokens: int, rows: int) -> None:
        """Before a device-transport step: this rank's real dispatch rows (`share_tokens` of the step's `real`
        tokens out of `step_tokens`) and the transport: blocks of ceil(rows / tp) rows, or counted (EAGER_STEP)."""
        block_rows = 0 if rows >= EAGER_STEP else max(1, -(-rows // self.tp))
        self.world.begin_step(share_tokens(real, step_tokens, self.tp, self.rank % self.tp), block_rows)

    def _routed_to_host(self) -> None:
        """After a device-transport step: its per-expert counts copied back without waiting (`finish_step` reads
        them after the step's one wait)."""
        self.routed_host.copy_(self.world.ep_comm.routed, non_blocking=True)
        self.counts_pending = True

    def finish_step(self, sampled: SampledTokens | None = None, *, waited: bool = False) -> None:
        """After a device-transport step, on every rank (the counts are summed over the tp group): the step's one
        wait (`wait_for_step`: the sampled ids' copy, else the stream; none when the caller `waited` already),
        then its per-expert counts from their pinned copy. Nothing for other steps (their counts are read in
        `_run`)."""
        if not self.counts_pending:
            return
        self.counts_pending = False
        if not waited:
            wait_for_step(sampled, self._synchronize)
        self._count_experts(self.routed_host.numpy())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def step_logits(self, batch: StepBatch | None) -> torch.Tensor | None:
        """One step (the decode CUDA graph of its bucket when there is one); logits [N, vocab] fp32 on the device."""
        if batch is None and not self.dp_layout:
            raise InputError("an idle step (no batch) exists only in the dp layout, where groups join the MoE "
                             "all-to-alls without tokens")
        self.use_device()
        if self.comm is None and self.dp_layout:
            return self._groups([batch] + [None] * (self.dp - 1))[0]
        if self.device_transport():
            return self._device_transport_step(batch)
        if self.graphs is not None and batch is not None and self.graphs.covers(batch):
            check_step_batch(self, batch)
            return self.graphs.replay(batch)
        return self._run(dict.fromkeys(self.models, batch))[self.rank]

    def _device_transport_step(self, batch: StepBatch | None) -> torch.Tensor | None:
        """dp layout on the device transport: the world's agreed step (`agree_rows`): every rank replays the same
        decode bucket (idle ranks too, all rows padding), or runs eagerly; then the step's one wait."""
        rows = self.agree_rows(batch)
        if batch is not None:
            check_step_batch(self, batch)
        if self.graphs is not None and rows < EAGER_STEP:
            logits = self.graphs.replay(batch, rows)
        else:
            real = 0 if batch is None else int(batch.input_ids.shape[0])
            self.begin_moe_step(real, real, rows)
            logits = self._run({self.rank: batch})[self.rank]
        self._routed_to_host()
        return logits

    def step(self, batch: StepBatch | None) -> np.ndarray | None:
        """Run one packed step; logits [N, vocab] fp32 on the host (None for an idle dp-layout step)."""
        logits = self.step_logits(batch)
        host = None if logits is None else logits.cpu().numpy()  # a blocking copy: the step's wait
        self.finish_step(waited=host is not None)
        return host

    def sample(self, batch: StepBatch | None, sampling: SamplingBatch | None) -> SampledTokens | None:
        """`ModelRunner.sample`: one step, then the batched sampler on the device's logits (one copy back: the
        step's one wait, also in the dp layout, whose per-expert counts are read after it)."""
        logits = self.step_logits(batch)
        out = None if sampling is None or logits is None else choose_tokens(logits, sampling)
        self.finish_step(out)
        return out

    def _groups(self, batches: list[StepBatch | None]) -> list[torch.Tensor | None]:
        results = self._run({r: batches[r // self.tp] for r in self.models})
        return [None if b is None else results[g * self.tp] for g, b in enumerate(batches)]

    def step_groups(self, batches: list[StepBatch | None]) -> list[np.ndarray | None]:
        """dp layout in one process: one step of every attention group at once (None: that group idles)."""
        if self.comm is not None or not self.dp_layout:
            raise InputError("step_groups runs every attention group of a dp-layout engine in one process")
        if len(batches) != self.dp:
            raise InputError(f"the engine has {self.dp} attention groups, got {len(batches)} batches")
        self.use_device()
        return [None if x is None else x.cpu().numpy() for x in self._groups(batches)]

    def encode_images(self, items: list) -> list[np.ndarray]:
        """Tower embeddings of (pixel_values, grid) images, spread over the attention group under mpiexec."""
        from moe_export.runtime.engine.vision import encode_spread

        if self.vision is None:
            raise InputError(f"{self.dir}: this engine has no vision tower (text only)")
        self.use_device()
        return encode_spread(self.vision, items, None if self.comm is None or self.tp == 1 else self.comm.groups["tp"])

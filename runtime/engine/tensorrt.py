"""TensorRT execution of a built engine directory (backend: tensorrt), behind the runtime's `Engine` interface.

NOT RUN ANYWHERE YET: no machine of this project has TensorRT (the lent GPU image has none either). Written
against TensorRT's public Python runtime API (>= 10.9): `Runtime.deserialize_cuda_engine`,
`ICudaEngine.create_execution_context`, `set_input_shape`, `get_tensor_shape`, `set_tensor_address`,
`execute_async_v3`. What is checked on CPU: the import guard and the plan read from `rank{N}.engine`.

One process per GPU under `mpiexec -n world_size` (rank from the MPI launcher, GPU = rank % visible GPUs).
`rank{N}.engine` (see `export/tensorrt_build.py`) holds one TensorRT engine per segment and the plan; the
collectives between segments run on torch.distributed's NCCL process groups (tp / ep groups of consecutive
ranks, as `graphs.sharding.Mapping` lays them out), on the same CUDA stream as the engines. Device buffers
are torch CUDA tensors. The JIT plugins run in this process (their modules are imported before the engines
are deserialized), so TensorRT calls back into Python for them.

State pools are torch tensors owned here, sized as `runtime.engine.ort` does for ONNX Runtime (recurrent state
[S, ...] per KDA layer; paged MLA / indexer caches [NB, BS, W] in the recipe's cache dtype). The engines update
them in place: GatedDeltaScan / ShortConv rewrite the step's slots and `PagedCacheWrite` stores the step's cache
rows, each through a plugin output `<pool>.written` aliased to the pool input, which this runner binds to the
pool's own buffer (O(tokens) per step; nothing is written back after the step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moe_export.export.errors import InputError
from moe_export.export.mpi import mpi_world
from moe_export.export.planner import engine_pool_sizes
from moe_export.graphs.onnx_export import WRITTEN_SUFFIX
from moe_export.runtime.engine.batch import (DEFAULT_BLOCK_SIZE, RESET_ON_NEW_SEQUENCE, STATE_PREFIXES, StepBatch,
                                            check_slot, check_step_batch)


def read_engine_file(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(plan, {segment name: serialized TensorRT engine}) from a `rank{N}.engine` safetensors file."""
    from safetensors import safe_open

    from moe_export.export.tensorrt_build import PLAN_KEY

    if not path.is_file():
        raise InputError(f"{path}: missing (was this engine built with backend tensorrt?)")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if PLAN_KEY not in meta:
            raise InputError(f"{path}: not a moe-export TensorRT engine file (no {PLAN_KEY} metadata)")
        plan = json.loads(meta[PLAN_KEY])
        blobs = {name: f.get_tensor(name).tobytes() for name in f.keys()}
    missing = [s["segment"] for s in plan["steps"] if "segment" in s and s["segment"] not in blobs]
    if missing:
        raise InputError(f"{path}: plan names segments the file lacks: {missing}")
    return plan, blobs


def pool_shapes(graph_path: Path, sizes: dict[str, int]) -> dict[str, tuple[list[int], int]]:
    """{state input: (shape with S / NB / BS resolved from `sizes`, ONNX element type)} of a rank graph."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    out = {}
    for vi in model.graph.input:
        if vi.name.startswith(STATE_PREFIXES):
            dims = [d.dim_value if d.HasField("dim_value") else sizes[d.dim_param] for d in vi.type.tensor_type.shape.dim]
            out[vi.name] = (dims, vi.type.tensor_type.elem_type)
    return out


class TensorRTEngine:
    """The `Engine` interface (RUNTIME_API.md section 1) over TensorRT engines, one rank per process."""

    def __init__(self, engine_dir: str | Path, *, num_slots: int | None = None, num_blocks: int | None = None,
                 threads: int | None = None):  # fmt: skip
        self.dir = Path(engine_dir)
        cfg_path = self.dir / "config.json"
        if not cfg_path.is_file():
            raise InputError(f"{self.dir}: not an engine directory (no config.json)")
        self.config = json.loads(cfg_path.read_text())
        if self.config.get("backend") != "tensorrt":
            raise InputError(f"{self.dir}: built for backend {self.config.get('backend')!r}, not tensorrt")
        from moe_export.export.tensorrt_build import import_tensorrt, register_plugins

        trt = import_tensorrt(self.config.get("recipe", {}).get("name", str(self.dir)))
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise InputError("the TensorRT runtime needs a CUDA device")
        limits = self.config["limits"]
        self.model_config: dict = self.config.get("pretrained_config", {})
        # a K3 text graph takes image rows; this runner has no tower (image parts are refused), so it feeds none
        text = self.model_config.get("text_config", self.model_config)
        self._no_images = ({"image_rows": np.zeros(0, np.int64), "image_embeds": np.zeros((0, text["hidden_size"]), np.float32)}
                           if "vision_config" in self.model_config else {})
        self.world_size = int(self.config["mapping"]["world_size"])
        self.tp, self.ep = int(self.config["mapping"]["tp_size"]), int(self.config["mapping"]["ep_size"])
        self.num_slots = num_slots or int(limits["max_batch"])
        if self.num_slots > int(limits["max_batch"]):
            raise InputError(f"num_slots={self.num_slots}: the engines' profiles allow at most max_batch="
                             f"{limits['max_batch']} state slots (rebuild with a larger limits.max_batch)")
        self.max_seq_len = int(limits["max_seq_len"])
        self.max_num_tokens = int(limits["max_num_tokens"])
        self.max_step_pairs = None  # the plugins stream over the context (online softmax): no [T, context] rows
        self.block_size = int(limits.get("block_size", DEFAULT_BLOCK_SIZE))
        self.num_blocks = num_blocks or engine_pool_sizes(self.config, self.num_slots).num_blocks
        world = mpi_world() or (0, 1)
        if world[1] != self.world_size:
            raise InputError(f"{self.dir}: engine has {self.world_size} ranks; run it under mpiexec -n {self.world_size}")
        self.rank = world[0]
        torch.cuda.set_device(self.rank % torch.cuda.device_count())
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = _NcclGroups(self.rank, self.world_size, self.tp, self.ep) if self.world_size > 1 else None
        self.stream = torch.cuda.Stream()

        rank_dir = self.dir / f"rank{self.rank}"
        plan, blobs = read_engine_file(rank_dir / f"rank{self.rank}.engine")
        self.steps = plan["steps"]
        register_plugins()  # the JIT plugins' Python callbacks must exist before deserialization
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engines = {name: self._runtime.deserialize_cuda_engine(blob) for name, blob in blobs.items()}
        if any(e is None for e in self._engines.values()):
            raise InputError(f"{rank_dir}: TensorRT could not deserialize an engine (version or GPU mismatch?)")
        self._contexts = {name: e.create_execution_context() for name, e in self._engines.items()}
        self._trt, self._torch, self._dist = trt, torch, dist
        sizes = {"S": self.num_slots, "NB": self.num_blocks, "BS": self.block_size}
        self.pools = {
            name: torch.zeros(shape, dtype=self._torch_dtype_onnx(elem), device=self.device)
            for name, (shape, elem) in pool_shapes(rank_dir / "model.onnx", sizes).items()
        }

    # ---- Engine interface ----
    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def reset_slot(self, slot: int) -> None:
        check_slot(self, slot)
        for name, pool in self.pools.items():
            if name.startswith(RESET_ON_NEW_SEQUENCE):
                pool[slot].zero_()

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one packed step on this rank; returns logits [N, vocab] fp32 (every rank)."""
        check_step_batch(self, batch)
        torch = self._torch
        env = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
               for k, v in {**self._no_images, **batch.feeds()}.items()}
        env.update(self.pools)
        with torch.cuda.stream(self.stream):
            for step in self.steps:
                if "segment" in step:
                    self._run_segment(step, env)
                else:
                    self._collective(step, env)
            # every pool was updated inside the engines: plugin outputs `<pool>.written` aliased to the pools
        self.stream.synchronize()
        return env["logits"].float().cpu().numpy()

    # ---- internals ----
    def _torch_dtype(self, dtype):
        trt, torch = self._trt, self._torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int64: torch.int64, trt.int32: torch.int32, trt.uint8: torch.uint8, trt.bool: torch.bool}[dtype]  # fmt: skip

    def _torch_dtype_onnx(self, elem: int):
        from onnx import TensorProto

        torch = self._torch
        return {TensorProto.FLOAT: torch.float32, TensorProto.BFLOAT16: torch.bfloat16,
                TensorProto.FLOAT16: torch.float16, TensorProto.UINT8: torch.uint8}[elem]  # fmt: skip

    def _run_segment(self, step: dict, env: dict) -> None:
        engine, context = self._engines[step["segment"]], self._contexts[step["segment"]]
        for name in step["inputs"]:
            value = env[name].contiguous()
            env[name] = value
            context.set_input_shape(name, tuple(value.shape))
            context.set_tensor_address(name, value.data_ptr())
        for name in step["outputs"]:
            if name.endswith(WRITTEN_SUFFIX):  # aliased to its pool input: bound to the pool's own buffer
                env[name] = self.pools[name[: -len(WRITTEN_SUFFIX)]]
            else:
                shape = tuple(context.get_tensor_shape(name))
                env[name] = self._torch.empty(shape, dtype=self._torch_dtype(engine.get_tensor_dtype(name)),
                                              device=self.device)  # fmt: skip
            context.set_tensor_address(name, env[name].data_ptr())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to enqueue {step['segment']} (see the log above)")

    def _collective(self, step: dict, env: dict) -> None:
        src = env[step["input"]]
        if self.comm is None:
            env[step["output"]] = src
            return
        group = self.comm.groups[step["group"]]
        if step["collective"] == "AllReduce":
            out = src.clone()
            self._dist.all_reduce(out, group=group)
        else:
            parts = [self._torch.empty_like(src) for _ in range(self._dist.get_world_size(group))]
            self._dist.all_gather(parts, src.contiguous(), group=group)
            out = self._torch.cat(parts, dim=step["axis"])
        env[step["output"]] = out


class _NcclGroups:
    """torch.distributed NCCL world plus the tp and ep groups (consecutive ranks), set up from MPI's launch:
    rank 0's host and a free port are broadcast over MPI (or MASTER_ADDR / MASTER_PORT if set)."""

    def __init__(self, rank: int, world_size: int, tp: int, ep: int):
        import socket

        import torch.distributed as dist
        from mpi4py import MPI

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (addr and port):
            if rank == 0:
                with socket.socket() as s:
                    s.bind(("", 0))
                    addr, port = socket.gethostname(), str(s.getsockname()[1])
            addr, port = MPI.COMM_WORLD.bcast((addr, port), root=0)
        dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size)
        self.groups = {}
        for name, size in (("tp", tp), ("ep", ep)):
            for start in range(0, world_size, size):
                group = dist.new_group(list(range(start, start + size)))  # every rank creates every group
                if start <= rank < start + size:
                    self.groups[name] = group
        self.world = MPI.COMM_WORLD

    def broadcast(self, obj):
        return self.world.bcast(obj, root=0)

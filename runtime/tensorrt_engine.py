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

State pools ([S, ...] per layer, S = num_slots, L = max_seq_len) are torch tensors owned here. Outputs that a
plugin declares aliased to its pool input (GatedDeltaScan, ShortConv) are bound to the pool's own buffer, as
TensorRT's aliased plugin I/O requires; the graph's `<pool>.out` outputs get buffers of their own and replace
the pools after each step (the same functional contract as the ONNX Runtime runner). Known cost, to be removed
with the in-place paged state (issue 9 part 2): the `<pool>.out` copies, and the MLA / indexer caches being
written with ScatterND, which TensorRT runs out of place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moe_export.export.errors import InputError
from moe_export.runtime.engine import RESET_ON_NEW_SEQUENCE, STATE_PREFIXES, StepBatch, mpi_world

ALIASED_OUTPUTS = {"GatedDeltaScan": {1: 5}, "ShortConv": {1: 2}}  # op type -> {output index: input index}


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


def aliased_values(graph_path: Path) -> dict[str, str]:
    """{plugin output value: the input value it aliases} for the in-place pool plugins of a rank graph."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    out = {}
    for node in model.graph.node:
        for o, i in ALIASED_OUTPUTS.get(node.op_type, {}).items():
            out[node.output[o]] = node.input[i]
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
        self.world_size = int(self.config["mapping"]["world_size"])
        self.tp, self.ep = int(self.config["mapping"]["tp_size"]), int(self.config["mapping"]["ep_size"])
        self.num_slots = num_slots or int(limits["max_batch"])
        self.max_seq_len = int(limits["max_seq_len"])
        self.max_num_tokens = int(limits["max_num_tokens"])
        self.block_size = self.max_seq_len  # slot-addressed pools: one block per slot
        self.num_blocks = num_blocks or self.num_slots
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
        self.aliases = aliased_values(rank_dir / "model.onnx")
        register_plugins()  # the JIT plugins' Python callbacks must exist before deserialization
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engines = {name: self._runtime.deserialize_cuda_engine(blob) for name, blob in blobs.items()}
        if any(e is None for e in self._engines.values()):
            raise InputError(f"{rank_dir}: TensorRT could not deserialize an engine (version or GPU mismatch?)")
        self._contexts = {name: e.create_execution_context() for name, e in self._engines.items()}
        self._trt, self._torch, self._dist = trt, torch, dist
        self.pools = self._allocate_pools()

    # ---- Engine interface ----
    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def reset_slot(self, slot: int) -> None:
        for name, pool in self.pools.items():
            if name.startswith(RESET_ON_NEW_SEQUENCE):
                pool[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        for pool in self.pools.values():
            pool[dst].copy_(pool[src])

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one packed step on this rank; returns logits [N, vocab] fp32 (every rank)."""
        torch = self._torch
        env = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in batch.feeds().items()}
        env.update(self.pools)
        with torch.cuda.stream(self.stream):
            for step in self.steps:
                if "segment" in step:
                    self._run_segment(step, env)
                else:
                    self._collective(step, env)
        self.stream.synchronize()
        for name in self.pools:
            self.pools[name] = env[f"{name}.out"]
        return env["logits"].float().cpu().numpy()

    # ---- internals ----
    def _torch_dtype(self, dtype):
        trt, torch = self._trt, self._torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int64: torch.int64, trt.int32: torch.int32, trt.uint8: torch.uint8, trt.bool: torch.bool}[dtype]  # fmt: skip

    def _allocate_pools(self) -> dict:
        """Zeroed pools for every state input: the profile's maximum shape (L = max_seq_len) with S = num_slots."""
        pools = {}
        for engine in self._engines.values():
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                if not name.startswith(STATE_PREFIXES) or name.endswith(".out") or name in pools:
                    continue
                if engine.get_tensor_mode(name) != self._trt.TensorIOMode.INPUT:
                    continue
                shape = [int(d) for d in engine.get_tensor_profile_shape(name, 0)[2]]
                if self.num_slots > shape[0]:
                    raise InputError(f"num_slots={self.num_slots} exceeds the engine's {shape[0]} slots ({name})")
                shape[0] = self.num_slots
                dtype = self._torch_dtype(engine.get_tensor_dtype(name))
                pools[name] = self._torch.zeros(shape, dtype=dtype, device=self.device)
        return pools

    def _run_segment(self, step: dict, env: dict) -> None:
        engine, context = self._engines[step["segment"]], self._contexts[step["segment"]]
        for name in step["inputs"]:
            value = env[name].contiguous()
            env[name] = value
            context.set_input_shape(name, tuple(value.shape))
            context.set_tensor_address(name, value.data_ptr())
        for name in step["outputs"]:
            if name in self.aliases and self.aliases[name] in env:  # in-place pool output: the pool's buffer
                env[name] = env[self.aliases[name]]
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

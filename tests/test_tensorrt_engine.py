"""The TensorRT runtime's CPU-checkable parts: the engine file, pool sizes within the profile, return-value checks,
one stream per rank, the import guard. (Execution needs TensorRT and a GPU; the context and torch.cuda are
stand-ins here, recording what the runner asks of them.)"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from conftest import write_engine_config
from moe_export.common.errors import InputError
from moe_export.common.engine_file import ENGINE_KEY, read_engine_file
from moe_export.runtime.engine.batch import StepBatch
from moe_export.runtime.engine.tensorrt import (
    TensorRTEngine,
    decode_buckets,
    graph_buckets,
    is_decode,
    pad_decode_feeds,
    runner_pool_sizes,
)
from moe_export.runtime.engine.tensorrt_bind import bind, check_shape
from safetensors.numpy import save_file

META = {
    "rank": 0, "inputs": ["input_ids", "pool_table"], "outputs": ["logits"],
    "profile": {"input_ids": [[1], [256], [8192]], "pool_table": [[2, 3], [2, 3], [2, 3]]},
    "pool_limits": {"slots": 8, "blocks": 9000},
}  # fmt: skip


def test_engine_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "rank0.engine"
    save_file({"engine": np.frombuffer(b"serialized", np.uint8)}, str(path), metadata={ENGINE_KEY: json.dumps(META)})
    meta, blob = read_engine_file(path)
    assert meta == META and blob == b"serialized"
    save_file({"other": np.zeros(1, np.uint8)}, str(path), metadata={ENGINE_KEY: json.dumps(META)})
    with pytest.raises(InputError, match="no 'engine' tensor"):
        read_engine_file(path)
    save_file({"engine": np.zeros(1, np.uint8)}, str(path))
    with pytest.raises(InputError, match="not a moe-export TensorRT engine"):
        read_engine_file(path)


def test_pools_stay_within_the_build_profile():
    """Issue 18, defect 6: a runner opened with fewer slots than max_batch used to recompute the cache blocks from
    the memory the missing slots free (more than the profile's NB max); now blocks come from the profile."""
    from moe_export.common.recipe import load_recipe
    from moe_export.export.plan.planner import engine_pool_sizes

    assert runner_pool_sizes(META, 8, None, None) == (8, 9000)
    assert runner_pool_sizes(META, 8, 2, None) == (2, 9000)  # not more blocks for fewer slots
    assert runner_pool_sizes(META, 8, None, 100) == (8, 100)
    with pytest.raises(InputError, match="at most 8 state slots"):
        runner_pool_sizes(META, 8, 9, None)
    with pytest.raises(InputError, match="at most 9000 cache blocks"):
        runner_pool_sizes(META, 8, None, 9001)
    # what the old rule would have allocated for a 2-slot runner of a real recipe: beyond the build's profile
    recipe, _ = load_recipe("tiny-cpu.yaml")
    from moe_export.export.convert.synth import preset_config

    cfg = preset_config("tiny-k3")
    assert engine_pool_sizes(recipe, cfg, 2).num_blocks > engine_pool_sizes(recipe, cfg).num_blocks


class FakeContext:
    """Records calls; refuses what `refuse` names (TensorRT returns False, never raises)."""

    def __init__(self, refuse=()):
        self.refuse, self.calls = set(refuse), []

    def set_input_shape(self, name, shape):
        self.calls.append(("shape", name, shape))
        return ("shape", name) not in self.refuse

    def set_tensor_address(self, name, ptr):
        self.calls.append(("address", name, ptr))
        return ("address", name) not in self.refuse


class Buf:
    def __init__(self, shape, ptr=0x1000):
        self.shape, self.ptr = shape, ptr

    def data_ptr(self):
        return self.ptr


def test_every_return_value_is_checked():
    """Issue 18, defect 6: set_input_shape / set_tensor_address report refusal by returning False."""
    inputs = {"input_ids": Buf((5,)), "pool_table": Buf((2, 3))}
    ctx = FakeContext()
    bind(ctx, META, inputs, {"logits": Buf((1, 10))})
    assert [c[:2] for c in ctx.calls] == [("shape", "input_ids"), ("shape", "pool_table"), ("address", "input_ids"),
                                          ("address", "pool_table"), ("address", "logits")]  # fmt: skip
    with pytest.raises(RuntimeError, match="refused input shape"):
        bind(FakeContext({("shape", "pool_table")}), META, inputs, {})
    with pytest.raises(RuntimeError, match="refused the address of logits"):
        bind(FakeContext({("address", "logits")}), META, inputs, {"logits": Buf((1, 10))})
    with pytest.raises(InputError, match="outside the engine's profile"):
        check_shape(META, "input_ids", (9000,))
    with pytest.raises(InputError, match="outside the engine's profile"):
        check_shape(META, "pool_table", (3, 3))


# ------------------------------------------------------------------ one stream (torch.cuda stand-in)
class FakeStream:
    cuda_stream = 0xC0FFEE

    def synchronize(self):
        RECORD.append(("synchronize", None))


RECORD: list = []
CURRENT = {"stream": None}


class FakeTensor:
    def __init__(self, shape, data=None):
        self.shape = tuple(shape)
        self.data = np.zeros(self.shape, np.float32) if data is None else data
        RECORD.append(("alloc", CURRENT["stream"]))

    def _op(self, what):
        RECORD.append((what, CURRENT["stream"]))
        return self

    def to(self, *a, **k):
        return FakeTensor(self.shape, self.data)._op("copy")

    def float(self):
        return self

    def zero_(self):
        return self._op("zero")

    def copy_(self, other, **kwargs):
        return self._op("copy")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FakeTensor(self.shape, self.data[i] if self.data.ndim else self.data)
        return FakeTensor(self.shape[1:])

    def data_ptr(self):
        return 0x2000

    def numpy(self):
        return self.data


class FakeGraph:
    def replay(self):
        RECORD.append(("replay", CURRENT["stream"]))


class FakeTorch:
    float32 = "f32"

    class cuda:  # noqa: N801
        CUDAGraph = FakeGraph

        @staticmethod
        @contextlib.contextmanager
        def stream(s):
            before, CURRENT["stream"] = CURRENT["stream"], s
            try:
                yield
            finally:
                CURRENT["stream"] = before

        @staticmethod
        @contextlib.contextmanager
        def graph(g, stream=None, capture_error_mode="global"):
            RECORD.append(("capture_begin", stream, capture_error_mode))
            with FakeTorch.cuda.stream(stream):
                yield
            RECORD.append(("capture_end", stream))

    @staticmethod
    def from_numpy(a):
        return FakeTensor(a.shape, a)

    @staticmethod
    def empty(shape, dtype=None, device=None):
        return FakeTensor(shape)


class StepContext(FakeContext):
    def get_tensor_shape(self, name):
        return (1, 10)

    def execute_async_v3(self, handle):
        RECORD.append(("enqueue", CURRENT["stream"], handle))
        return True


def test_one_stream_for_every_copy_reset_and_enqueue():
    """Issue 18, defect 5: step inputs and slot resets ran on the legacy default stream while engines ran on
    another stream. Now everything of a rank goes on its one stream and the host waits once per step."""
    stream = FakeStream()
    engine = object.__new__(TensorRTEngine)
    engine._torch, engine.stream, engine.device = FakeTorch, stream, "cuda:0"
    engine._empty = FakeTensor((256,))
    engine.meta = {**META, "profile": {**META["profile"], "positions": [[1], [1], [8192]]}}
    engine.pools = {"kda_state.0": FakeTensor((8, 2, 4, 4))}
    engine.pool_table = {"pool_table": FakeTensor((2, 3))}
    engine._context = StepContext()
    engine._engine = type("E", (), {"get_tensor_dtype": lambda self, n: "f32"})()
    engine._torch_dtype = lambda dtype: dtype
    engine.num_slots, engine.num_blocks, engine.block_size = 8, 9000, 64
    engine.max_num_tokens, engine.max_seq_len = 8192, 4096
    engine._buckets = []  # the eager path (the profile leaves no padding slot for decode graphs)
    engine.dp_layout = False
    RECORD.clear()
    engine.reset_slot(3)
    batch = StepBatch(input_ids=np.array([5], np.int64), positions=np.array([0], np.int64),
                      cu_seqlens=np.array([0, 1], np.int64), slot_ids=np.array([0], np.int64),
                      block_tables=np.zeros((1, 1), np.int64))  # fmt: skip
    engine.step(batch)
    ops = [r for r in RECORD if r[0] != "synchronize"]
    assert ops and all(r[1] is stream for r in ops), ops  # nothing on the default stream (None)
    assert ("enqueue", stream, FakeStream.cuda_stream) in RECORD
    assert [r[0] for r in RECORD].count("synchronize") == 1 and RECORD[-1][0] == "synchronize"
    bound = {c[1] for c in engine._context.calls}  # issue 18, defect 4: the pool table, never a pool
    assert "pool_table" in bound and not bound & set(engine.pools)


def test_decode_buckets_and_padding():
    """Issue 18, defect 8 (CUDA graphs): decode steps are padded to a batch-size bucket onto the spare slot, with
    -1 table rows (no cache row written) and their own logits rows; real rows keep their place."""
    assert decode_buckets(24) == [1, 2, 4, 8, 16, 24] and decode_buckets(1) == [1] and decode_buckets(8)[-1] == 8
    batch = StepBatch(input_ids=np.array([5, 6, 7]), positions=np.array([9, 0, 130]), cu_seqlens=np.array([0, 1, 2, 3]),
                      slot_ids=np.array([4, 0, 2]), block_tables=np.array([[3, -1, -1], [1, -1, -1], [0, 2, 5]]))  # fmt: skip
    assert is_decode(batch)
    feeds = pad_decode_feeds(batch, 4, pad_slot=8, table_width=6)
    assert feeds["input_ids"].tolist() == [5, 6, 7, 0] and feeds["positions"].tolist() == [9, 0, 130, 0]
    assert feeds["slot_ids"].tolist() == [4, 0, 2, 8] and feeds["cu_seqlens"].tolist() == [0, 1, 2, 3, 4]
    assert feeds["last_token_index"].tolist() == [0, 1, 2, 3]
    assert feeds["block_tables"].shape == (4, 6) and (feeds["block_tables"][3] == -1).all()
    assert feeds["block_tables"][2].tolist() == [0, 2, 5, -1, -1, -1]
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        pad_decode_feeds(batch, 2, 8, 6)
    prefill = StepBatch(np.array([1, 2]), np.array([0, 1]), np.array([0, 2]), np.array([0]), np.array([[0]]))
    assert not is_decode(prefill)


class GraphContext(StepContext):
    def set_device_memory(self, ptr, size):
        RECORD.append(("device_memory", ptr, size))


def test_decode_steps_replay_a_cuda_graph_per_bucket():
    """The first decode step of a bucket runs eagerly, then is captured on the rank's stream; the next one
    replays it. The bucket's context shares the rank's one activation buffer."""
    stream = FakeStream()
    engine = object.__new__(TensorRTEngine)
    engine._torch, engine.stream, engine.device = FakeTorch, stream, "cuda:0"
    engine._empty = FakeTensor((256,))
    profile = {**META["profile"],
               "block_tables": [[1, 1], [1, 64], [8, 16]], "positions": [[1], [1], [8192]],
               "cu_seqlens": [[2], [9], [9]], "slot_ids": [[1], [8], [8]], "last_token_index": [[1], [8], [8]]}  # fmt: skip
    engine.meta = {**META, "profile": profile, "pool_limits": {"slots": 9, "blocks": 9000}}
    engine.pools = {"kda_state.0": FakeTensor((9, 2, 4, 4))}
    engine.pool_table = {"pool_table": FakeTensor((2, 3))}
    engine._engine = type("E", (), {"get_tensor_dtype": lambda self, n: "f32",
                                    "create_execution_context": lambda self, strategy: GraphContext()})()  # fmt: skip
    engine._trt = type("T", (), {"ExecutionContextAllocationStrategy": type("S", (), {"USER_MANAGED": 2})})
    engine._torch_dtype = lambda dtype: dtype
    engine._activations, engine._activation_size = FakeTensor((1,)), 4096
    engine.num_slots, engine.num_blocks, engine.block_size = 8, 9000, 64
    engine.max_num_tokens, engine.max_seq_len = 8192, 4096
    engine._pad_slot, engine._graphs, engine._buckets = 8, {}, decode_buckets(8)
    engine.dp_layout = False
    batch = StepBatch(np.array([5, 6, 7]), np.array([3, 4, 5]), np.array([0, 1, 2, 3]), np.array([0, 1, 2]),
                      np.array([[0], [1], [2]]))  # fmt: skip
    RECORD.clear()
    engine.step(batch)
    kinds = [r[0] for r in RECORD]
    assert ("device_memory", 0x2000, 4096) in RECORD  # the shared activation buffer
    assert kinds.count("enqueue") == 2 and kinds.index("capture_begin") < len(kinds) - kinds[::-1].index("enqueue")
    assert ("capture_begin", stream, "thread_local") in RECORD  # as TensorRT-LLM: other threads' CUDA calls allowed
    RECORD.clear()
    engine.step(batch)
    assert [r[0] for r in RECORD].count("replay") == 1 and "enqueue" not in [r[0] for r in RECORD]
    assert all(r[1] is stream for r in RECORD if r[0] not in ("synchronize", "device_memory"))
    assert list(engine._graphs) == [4]


def test_engine_needs_tensorrt_and_the_tensorrt_backend(tmp_path):
    write_engine_config(tmp_path, "onnxruntime")
    with pytest.raises(InputError, match="not tensorrt"):
        TensorRTEngine(tmp_path)
    write_engine_config(tmp_path, "tensorrt")
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        TensorRTEngine(tmp_path)


def test_open_engine_picks_the_runner_of_the_built_backend(tmp_path):
    """`LLM` and `moe-export generate` open engines through `open_engine`: a tensorrt build goes to the
    TensorRT runner (here: its clear import error), anything else to the ONNX Runtime runner."""
    from moe_export.runtime.engine import open_engine

    write_engine_config(tmp_path, "tensorrt")
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        open_engine(tmp_path)
    write_engine_config(tmp_path, "onnxruntime")
    with pytest.raises(InputError, match="no rank"):
        open_engine(tmp_path)


class FakeEp:
    """The ep communicator as the runner drives it: records `begin_step`; `routed` as the dispatches left it."""

    def __init__(self, routed):
        self.steps, self.routed = [], FakeTensor(routed.shape, routed)

    def begin_step(self, valid, block_rows):
        self.steps.append((valid, block_rows))


class FakeWorld:
    """MPI's world as `_agree_bucket` uses it: this rank's bids recorded, the other ranks' largest is `others`."""

    def __init__(self):
        self.bids, self.others = [], 0

    def allreduce(self, bid, op=None):
        self.bids.append(bid)
        return max(bid, self.others)


class HostBuf(FakeTensor):
    def copy_(self, other, **kwargs):
        self.data = np.array(other.data)
        return self._op("copy")


def dp_engine(routed):
    """A tp-2 dp-layout rank (tp rank 1) over stand-ins, decode buckets of up to 8, the spare slot 8."""
    from types import SimpleNamespace

    from moe_export.runtime.engine.tensorrt import EAGER_STEP

    engine = object.__new__(TensorRTEngine)
    engine._torch, engine.stream, engine.device = FakeTorch, FakeStream(), "cuda:0"
    engine._empty = FakeTensor((256,))
    profile = {**META["profile"],
               "block_tables": [[1, 1], [1, 64], [8, 16]], "positions": [[1], [1], [8192]],
               "cu_seqlens": [[2], [9], [9]], "slot_ids": [[1], [8], [8]], "last_token_index": [[1], [8], [8]]}  # fmt: skip
    engine.meta = {**META, "profile": profile, "pool_limits": {"slots": 9, "blocks": 9000}}
    engine.pool_table = {"pool_table": FakeTensor((2, 3))}
    engine.pools = {"kda_state.0": FakeTensor((9, 2, 4, 4))}
    engine.comm = SimpleNamespace(nccl={"ep": FakeEp(routed)}, group_sum=lambda x: 2 * x, world=FakeWorld())
    engine._context = StepContext()
    engine._engine = type("E", (), {"get_tensor_dtype": lambda self, n: "f32",
                                    "create_execution_context": lambda self, strategy: GraphContext()})()  # fmt: skip
    engine._trt = type("T", (), {"ExecutionContextAllocationStrategy": type("S", (), {"USER_MANAGED": 2})})
    engine._torch_dtype = lambda dtype: dtype
    engine._activations, engine._activation_size = FakeTensor((1,)), 4096
    engine.num_slots, engine.num_blocks, engine.block_size = 8, 9000, 64
    engine.max_num_tokens, engine.max_seq_len = 8192, 4096
    engine.dp_layout, engine.tp, engine.mapping = True, 2, SimpleNamespace(tp_rank=1)
    engine._pad_slot, engine._graphs, engine._buckets = 8, {}, graph_buckets(8, 8)
    engine.step_expert_tokens = np.zeros(routed.shape, np.int64)
    engine.expert_tokens = np.zeros(routed.shape, np.int64)
    engine._routed_host = HostBuf(routed.shape)
    return engine, EAGER_STEP


def test_dp_steps_agree_on_the_world_bucket_and_set_the_dispatch_state():
    """dp layout: every rank runs one engine step per world step, of one kind agreed by a host all-reduce of bids
    (its decode bucket, or eager): all replay the largest bucket's CUDA graph, padded to it, with blocks of
    ceil(bucket / tp) rows per peer, or all run eagerly (counted transport, block 0). Before each enqueue or replay
    the ep communicator gets the real tokens of this rank's share (tp rank 1 of 2: rows from ceil(T/2)); an idle
    group has none. The step's per-expert counts come from the device with the step's one wait."""
    routed = np.array([[0, 3, 0, 3], [1, 0, 0, 2]])
    engine, eager = dp_engine(routed)
    ep, world = engine.comm.nccl["ep"], engine.comm.world
    world.others = eager  # another group prefills: an eager idle step (one dummy token, nothing real)
    RECORD.clear()
    assert engine.step(None) is None
    assert world.bids == [1] and ep.steps == [(0, 0)] and engine._graphs == {}
    shapes = {c[1]: c[2] for c in engine._context.calls if c[0] == "shape"}
    assert shapes["input_ids"] == (1,) and shapes["slot_ids"] == (1,) and shapes["block_tables"] == (1, 1)
    assert [r[0] for r in RECORD].count("synchronize") == 1 and RECORD[-1][0] == "synchronize"
    assert engine.step_expert_tokens.tolist() == routed.tolist()
    assert engine.group_step_expert_tokens.tolist() == (2 * routed).tolist()  # summed over the tp group
    world.others = 4  # another group decodes 3 or 4 sequences: the idle group replays bucket 4 with no real row
    ep.steps.clear()
    engine.step(None)
    assert ep.steps == [(0, 2), (0, 2)] and list(engine._graphs) == [4]  # eager first run, then the capture
    world.others = 1
    batch = StepBatch(np.array([5, 6, 7]), np.array([3, 4, 5]), np.array([0, 1, 2, 3]), np.array([0, 1, 2]),
                      np.array([[0], [1], [2]]))  # fmt: skip
    ep.steps.clear()
    RECORD.clear()
    engine.step(batch)  # its own bucket 4 is the world's: a replay, 1 real token in rows 2..3 of the padded 4
    assert world.bids[-1] == 4 and ep.steps == [(1, 2)] and [r[0] for r in RECORD].count("replay") == 1
    assert engine.expert_tokens.tolist() == (3 * routed).tolist()
    prefill = StepBatch(np.array([1, 2, 3, 4, 5]), np.array([0, 1, 2, 3, 4]), np.array([0, 5]), np.array([0]),
                        np.array([[0]]))  # fmt: skip
    ep.steps.clear()
    engine.step(prefill)  # eager: 5 tokens, rows 3..4 are this rank's, all real
    assert world.bids[-1] == eager and ep.steps == [(2, 0)]
    engine.dp_layout = False
    with pytest.raises(InputError, match="only in the dp layout"):
        engine.step(None)


def test_dp_step_failing_validation_on_one_rank_is_refused_by_every_rank():
    """dp layout: a rank whose step fails validation still joins the bucket agreement (bidding REFUSED_STEP) before
    raising, so no other rank waits in the all-reduce for it; every rank then raises StepRefused (the failing one
    with its reason), nothing is enqueued, and the next world step runs as usual."""
    from moe_export.runtime.engine.runner import StepRefused
    from moe_export.runtime.engine.tensorrt import REFUSED_STEP

    engine, eager = dp_engine(np.zeros((2, 4), np.int64))
    world = engine.comm.world
    bad = StepBatch(np.array([5]), np.array([3]), np.array([0, 1]), np.array([99]), np.array([[0]]))  # slot 99
    RECORD.clear()
    with pytest.raises(StepRefused, match="failed validation: .*slot 99"):
        engine.step(bad)
    assert world.bids == [REFUSED_STEP] and engine._context.calls == [] and RECORD == []
    world.others = REFUSED_STEP  # another group's step failed validation: this rank's good step and idle step refuse
    good = StepBatch(np.array([5]), np.array([3]), np.array([0, 1]), np.array([0]), np.array([[0]]))
    with pytest.raises(StepRefused, match="another rank's step"):
        engine.step(good)
    with pytest.raises(StepRefused, match="another rank's step"):
        engine.step(None)
    assert world.bids[1:] == [1, 1] and engine._context.calls == []
    world.others = eager
    engine.step(good)  # the next world step (another group prefills): eager everywhere
    assert world.bids[-1] == 1 and engine._context.calls


def test_context_memory_binding_names_are_in_the_pinned_wheels():
    """Contract USER_MANAGED_DEVICE_MEMORY: every Python name the runner uses for user-managed context memory is
    in the pinned TensorRT bindings wheels' compiled module, and `set_device_memory` is their binding of
    setDeviceMemoryV2 (the lambda and the docstring that name it). Reads the wheels' own tensorrt.so bytes."""
    import re
    import zipfile
    from pathlib import Path

    from moe_export.plugins.tensorrt_contracts import BINDING_NAMES

    from tests.tensorrt_standin import PINNED_WHEELS, WHEEL_DIR

    runner = (Path(__file__).resolve().parents[1] / "runtime/engine/tensorrt.py").read_text()
    used = set(re.findall(r"\.(set_device_memory|device_memory_size_v2|create_execution_context|USER_MANAGED)\b",
                          runner))
    assert used == set(BINDING_NAMES)
    for version, stem in PINNED_WHEELS.items():
        wheels = sorted(WHEEL_DIR.glob(f"{stem}-*.whl"))
        assert wheels, f"no {stem} wheel in {WHEEL_DIR}: run the README's test command"
        with zipfile.ZipFile(wheels[0]) as zf:
            so = zf.read("tensorrt_bindings/tensorrt.so")
        for name, evidence in BINDING_NAMES.items():
            assert b"\0" + name.encode() + b"\0" in so, f"{version}: no binding named {name}"
            for fragment in evidence:
                assert fragment in so, f"{version}: {name}: {fragment!r} not in the bindings"

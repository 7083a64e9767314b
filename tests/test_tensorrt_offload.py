"""The TensorRT runner's offload rows (`TensorRTEngine` as `torch_rows.PoolRows`) under `mpiexec -n 2` (tp 2), over
the stand-ins of TensorRT's runtime and of torch.cuda (`tensorrt_runtime_standin.py`), through the offload turn the
ONNX Runtime and torch runners' test runs (`mpi_offload_run.offload_turn`, driven by `mpi_tensorrt_offload_run.py`).

Verified: each rank's runner, opened by its real constructor (the plan streamed in, the pools and their table
allocated, the warm-up steps, its MPI communicators and torch.distributed groups), reads its own pool rows into
`rank{N}/` of the store (the stand-in's steps write nothing, so each rank's rows hold known values the script wrote,
distinct per rank, pool, row and run), and after a restart (new processes, other values in every pool) the agreed
load writes turn 1's rows of that rank back bit for bit: the kept session's state rows into the new slot, its full
blocks and its tail block into the new block table, in order; likewise a checkpoint at a block boundary (read from
the runner's host checkpoints, its `save_state` copy of the slot) with its blocks. With one rank's state files
damaged, no rank loads.
NOT verified here: the tokens (nothing computes; they are whatever the uninitialized logits give), the stream
ordering of the reads and writes against the steps (one host, no stream runs asynchronously), NCCL (the engine's
groups run on gloo) and the plugins writing the rows (tests/test_tensorrt_plugins.py covers the plugins)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from moe_export.common.engine_config import EngineConfig
from moe_export.export.backends import backend_for
from moe_export.export.backends.tensorrt import engine as tensorrt_build
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.rank import convert_rank
from moe_export.export.convert.synth import preset_config, write_synthetic_checkpoint
from moe_export.export.plan.planner import engine_memory, make_plan
from moe_export.graphs.onnx_export import export_rank_graph
from moe_export.graphs.sharding import Mapping
from test_build_tensorrt import fake_tensorrt
from test_runtime_state_offload import TOOL, TURN1, damage, mpi_turn
from test_tensorrt_runner_start import trt_recipe

SCRIPT = Path(__file__).with_name("mpi_tensorrt_offload_run.py")
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tensorrt_tp2_engine(tmp_path_factory) -> Path:
    """A tiny-k3 TensorRT engine folder for mpiexec -n 2 (tp 2, ep 2, block size 16, fp8 cache pools): each rank's
    graph exported as a TensorRT build exports it, its engine file made by the builder driver against the recording
    builder of test_build_tensorrt.py (as test_tensorrt_runner_start.py makes one rank's)."""
    base = trt_recipe("tp")
    recipe = base.model_copy(update={
        "target": base.target.model_copy(update={"gpus_per_node": 2}),
        "limits": base.limits.model_copy(update={"max_batch": 4, "max_seq_len": 1024, "max_num_tokens": 64,
                                                 "block_size": BLOCK_SIZE}),
    })  # fmt: skip
    root = tmp_path_factory.mktemp("tensorrt-tp2")
    reader = open_checkpoint(write_synthetic_checkpoint("tiny-k3", root / "ckpt", 0))
    folder = root / "engine"
    for rank in range(recipe.target.world_size):
        mapping = Mapping.from_recipe(recipe, rank)
        rank_dir = folder / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        convert_rank(reader, reader.config, recipe, mapping, rank_dir / "weights.safetensors")
        export_rank_graph(reader.config, recipe, mapping, rank_dir / "weights.safetensors", rank_dir / "model.onnx",
                          backend_for(recipe).graph_form)
        view = make_plan(recipe).per_rank[rank].memory
        planned = view["activations"] + sum(view.get(f"workspace.{k}", 0) for k in tensorrt_build.ENGINE_WORKSPACES)
        with pytest.MonkeyPatch.context() as m:
            m.setitem(sys.modules, "tensorrt", fake_tensorrt([], device_memory=planned))
            m.setattr(tensorrt_build, "register_plugins", lambda: None)
            m.setattr(tensorrt_build, "select_device", lambda: 0)
            tensorrt_build.build_tensorrt_engine(rank_dir / "model.onnx", recipe, mapping,
                                                 rank_dir / f"rank{rank}.engine")
    model = preset_config("tiny-k3")
    EngineConfig.from_recipe(recipe, model, version="test", files={}, weight_classes={},
                             memory=engine_memory(recipe, model)).write(folder)
    return folder


def tensorrt_turn(engine_dir, store, prompt: list[int], n: int, run: int, earlier: dict | None = None) -> dict:
    """One request on a fresh mpiexec -n 2 world of TensorRT runners, their pools holding run `run`'s values;
    `earlier`: run 1's kept session, whose rows every load must write back."""
    extra = (str(run),) + ((json.dumps(earlier),) if earlier is not None else ())
    return mpi_turn(engine_dir, store, prompt, n, *extra, script=SCRIPT)


def test_tensorrt_tp_ranks_offload_their_own_rows_and_load_them_back_bit_exactly(tensorrt_tp2_engine, tmp_path):
    """mpiexec -n 2, tp 2, TensorRT runner over the stand-ins: each rank writes its own rows to `rank{N}/`; after a
    restart the follow-up turn resumes from them (cached = loaded = turn 1's kept session) and every rank's load
    writes that rank's turn-1 rows back bit for bit (the state, then 4 full blocks and the tail's block; a prompt
    diverging after the 4th block: the checkpoint there and the 4 blocks); with one
    rank's state files damaged, no rank loads (the ranks agree) and nothing is written into any pool."""
    first = tensorrt_turn(tensorrt_tp2_engine, tmp_path / "state", TURN1, 6, 1)
    assert first["cached"] == 0 and all(first["written"])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]
    kept = first["kept"]
    assert kept["tokens"] == len(TURN1) + len(first["tokens"]) - 1  # every token but the last sampled one was fed
    shutil.copytree(tmp_path / "state", tmp_path / "damaged")
    shutil.copytree(tmp_path / "state", tmp_path / "checkpoint")
    prompt2 = TURN1 + first["tokens"] + TOOL
    resumed = tensorrt_turn(tensorrt_tp2_engine, tmp_path / "state", prompt2, 5, 2, kept)
    assert resumed["cached"] == resumed["loaded"] == kept["tokens"] and resumed["rejected"] == [0, 0]
    blocks = -(-kept["tokens"] // BLOCK_SIZE)  # 75 tokens: 4 full blocks and the tail's
    assert resumed["loads"] == [{"slots": 1, "blocks": blocks, "bad": []}] * 2
    # a prompt leaving turn 1 after its 4th block: the checkpoint committed there (read from the runner's pinned host
    # checkpoints, a copy of the slot's state rows) and the 4 full blocks are loaded
    diverged = tensorrt_turn(tensorrt_tp2_engine, tmp_path / "checkpoint", TURN1[:64] + TOOL, 5, 2, kept)
    assert diverged["cached"] == diverged["loaded"] == 64 and diverged["rejected"] == [0, 0]
    assert diverged["loads"] == [{"slots": 1, "blocks": 4, "bad": []}] * 2
    states = sorted((tmp_path / "damaged" / "rank1").glob("s-*.safetensors"))
    assert states
    for path in states:
        damage(path, "tampered")
    fallback = tensorrt_turn(tensorrt_tp2_engine, tmp_path / "damaged", prompt2, 5, 2, kept)
    assert fallback["cached"] == fallback["loaded"] == 0 and fallback["rejected"] == [0, len(states)]
    assert fallback["loads"] == [{"slots": 0, "blocks": 0, "bad": []}] * 2

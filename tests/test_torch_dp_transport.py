"""The torch runner's dp layout on the device transport (`DistributedWorld.use_device_transport`: the MoE
all-to-alls as the TensorRT runner's plugins run them) under `mpiexec -n 4` (tp 2 x 2 attention groups, experts over
4 ranks; gloo, the Triton kernels in Triton's interpreter): a prefill (counted transport), eager decode steps
(blocks; one with group 1 idle), and decode steps replayed from `DecodeGraphs` (eager stand-ins for the CUDA graphs: the world's agreed
bucket, group 1 idle replaying padding) give the ONNX Runtime engine's logits, and a decode step reads nothing back
on any rank; its per-expert counts are read from their host copy after the step's one wait (`finish_step`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp32_reorder import num_layers, reorder_atol
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine

from test_plugin_moe_mxfp4 import BF16_TOL

P0, P1, P2 = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400], list(range(3, 40)), [60, 61, 62]
STEPS = [  # per step, per group: chunks [slot, start, tokens, blocks], or None (idle)
    [[[0, 0, P0, [0, 6]], [1, 0, P2, [2, 4]]], [[0, 0, P1, [5, 3, 9]]]],  # prefill: counted
    [[[0, 14, [7], [0, 6]], [1, 3, [6], [2, 4]]], [[0, 37, [8], [5, 3, 9]]]],  # eager decode: blocks of 1 row
    [[[0, 15, [9], [0, 6]]], None],  # eager decode, group 1 idle (no token: its dispatches send nothing)
    [[[0, 16, [10], [0, 6]], [1, 4, [10], [2, 4]]], None],  # graphs: bucket 2 agreed, group 1 replays padding
    [[[1, 5, [11], [2, 4]]], [[0, 38, [12], [5, 3, 9]]]],  # graphs: bucket 1
]
GRAPHS_FROM = 3


@pytest.mark.slow  # 20-42 s on 2 cores: the default run stays under 20 minutes
def test_dp_decode_steps_on_the_device_transport(runtime_engine):
    torch_dir = runtime_engine("tiny-k3", 2, 4, 4, attention="dp", backend="torch")
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", "4", sys.executable, str(Path(__file__).with_name("mpi_torch_dp_run.py")),
                        str(torch_dir), json.dumps(STEPS), str(GRAPHS_FROM)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["moe_err"] < BF16_TOL  # the bf16 W4A16 kernel against the fp32 one on the same bf16 x
    ort = Engine(runtime_engine("tiny-k3", 2, 4, 4, attention="dp"), num_slots=2, num_blocks=16, threads=1)
    for n, step in enumerate(STEPS):
        want = ort.step_groups([None if cs is None else StepBatch.from_sequences([SequenceChunk(*c) for c in cs])
                                for cs in step])
        for g, (a, b) in enumerate(zip(got["logits"][n], want)):
            assert (a is None) == (b is None), (n, g)
            if b is not None:  # fp32 both; the interpreter's expert dots sum in another order than ORT's
                atol = reorder_atol(b, num_layers(ort.model_config), ort.max_seq_len)
                np.testing.assert_allclose(np.asarray(a), b, atol=atol, rtol=0, err_msg=f"step {n} group {g}")
        assert got["expert_tokens"][n] > 0
    for n in (1, 2, 3, 4):  # decode steps: nothing read in the step; after it, the per-expert counts' host copy
        assert all(calls == [] for calls in got["reads"][n]), got["reads"][n]
        assert all(calls == ["numpy"] for calls in got["finish_reads"][n]), got["finish_reads"][n]

"""The prepared GPU run (`benchmarks/gpu_check.sh`) before a GPU is lent: the shell script parses, its Python
parts compile and import, the sampler step runs end to end with `--device cpu` (small vocabulary), and the
kernel step runs every check in its smoke mode (tiny shapes, Triton's interpreter on CPU)."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp32_reorder import BF16_U

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_gpu_check_script_parses_and_runs_every_step():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    steps = [line.split()[3] for line in text.splitlines() if line.startswith("timeout ")]
    assert steps == ["benchmarks/gpu_aot_check.py", "benchmarks/gpu_check.py", "benchmarks/gpu_sampler_check.py",
                     "benchmarks/gpu_trt_check.py", "benchmarks/gpu_dp_step_check.py"]
    # one device command runs at most 10 minutes: the steps' limits leave room for the start and the merge
    assert sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("timeout ")) < 8 * 60
    for step in steps:
        py_compile.compile(str(REPO / step), doraise=True)


def test_gpu_sampler_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "sampler.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_sampler_check.py"), "--device", "cpu", "--batches",
                    "1,16", "--vocab", "4096", "--repeats", "2", "--json", str(out)], check=True, capture_output=True)
    fig = json.loads(out.read_text())
    for n in (1, 16):
        assert fig[f"sampler_ms_greedy_{n}"] > 0 and fig[f"sampler_ms_top_p_{n}"] > 0
        assert fig[f"sampler_top_p_over_greedy_{n}"] == fig[f"sampler_ms_top_p_{n}"] / fig[f"sampler_ms_greedy_{n}"]
    assert fig["sampler_seeded_alone_equals_batch"] is True and fig["sampler_seeded_rows_checked"] == 4
    assert fig["sampler_greedy_equals_torch_argmax"] is True
    assert fig["sampler_seeded_device_equals_cpu_frac"] == 1.0  # the CPU against itself


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_sampler_check_refuses_a_missing_device():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_sampler_check.py"), "--device", "cuda"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "no CUDA device here" in run.stderr


def test_gpu_check_python_parts_import_on_cpu():
    """gpu_check.py imports (torch, triton and our kernels, no GPU needed to import)."""
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


GOAL_KEYS = ("kda_prefill_vs_fla", "kda_decode_vs_fla", "moe_decode_bw_frac", "moe_prefill_tflops_frac",
             "sparse_mla_bw_frac_", "sparse_mla_ms_1", "indexer_bw_frac_128k", "read_bw_gbps", "bf16_matmul_tflops")


def test_gpu_check_smoke_mode_runs_every_check(tmp_path):
    """GPU_CHECK_SMOKE=1 under TRITON_INTERPRET=1: every check runs at tiny shapes on CPU (our references
    standing in for fla), writes every goal key with its correctness figure, and records no error."""
    out = tmp_path / "kernels.json"
    env = dict(os.environ, GPU_CHECK_SMOKE="1", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--json", str(out)], cwd=REPO,
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["gpu_check_smoke"] is True
    assert not [k for k in fig if k.endswith("_error")], {k: v for k, v in fig.items() if k.endswith("_error")}
    for key in GOAL_KEYS:
        assert any(k.startswith(key) and isinstance(v, float) and v > 0 for k, v in fig.items()), key
    assert fig["indexer_topk_score_ok"] is True
    # bf16 outputs on both sides (2 u_bf16 at the output's scale) plus a bf16-rounded operand carried through one
    # sum (the KDA state or the MoE activation, 2 u_bf16 more): 4 u_bf16 of max|output|, which gpu_check divides
    # out where it exceeds 1 (rel_diff) and which is O(1) for KDA (l2-normed q, k); smoke run: worst 7.9e-3
    assert max(v for k, v in fig.items() if "max_abs_diff" in k or "rel_diff" in k) < 4 * BF16_U

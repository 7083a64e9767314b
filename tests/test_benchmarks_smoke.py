"""Every benchmark script runs in its smoke mode (`--smoke`, or `--quick` where the script had one: tiny sizes),
so that a change to the runtime's contracts cannot leave a benchmark broken unseen; those over a minute on the
shared 2-core machine are marked slow. Scripts with their own tests elsewhere: `gpu_check.sh` and its steps
(test_gpu_check.py, test_dp_decode_model.py), `gpu_rank_step.py` and `gpu_torch_check.sh` (test_torch_backend.py).
Not run: `tensorrt_check.py` (TensorRT only), `gpu_aot_check.py` and `gpu_torch_check.py` (CUDA only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_smoke(script: str, *args: str, tmp_path: Path) -> dict:
    """Run `benchmarks/<script> <args> --json out`; its figures."""
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(out.read_text())


def test_host_overhead_smoke(tmp_path):
    """The host-overhead benchmark drives `LLM`'s core over its instant runner (the runner contract it mocks must
    keep up with the real one: it broke once on `dp_layout`)."""
    fig = run_smoke("host_overhead.py", "--smoke", tmp_path=tmp_path)
    for key in ("host_ms_per_step_1", "host_ms_per_step_4", "serial_ms_per_step_256", "overlap_ms_per_step_256",
                "sampler_ms_4_greedy", "sampler_ms_4_sampled_peaked"):
        assert fig[key] > 0, key


# (script, smoke arguments, a figure the run must write); slow: over a minute on the shared 2-core machine
SMOKE_RUNS = [
    pytest.param("runtime.py", ["--quick"], "batching_speedup_16", id="runtime"),
    pytest.param("batch.py", ["--smoke"], "batch_speedup", id="batch"),
    pytest.param("quantize.py", ["--smoke"], "encode_gbps", id="quantize"),
    pytest.param("convert.py", ["--smoke"], "convert_gbps", id="convert"),
    pytest.param("serve.py", ["--smoke"], "prefix_cache_ttft_speedup", id="serve", marks=pytest.mark.slow),
    pytest.param("wide_ep.py", ["--smoke"], "wide_ep_throughput_ratio", id="wide_ep", marks=pytest.mark.slow),
    pytest.param("vision.py", ["--quick", "--rounds", "1"], "vision_cache_ttft_speedup", id="vision", marks=pytest.mark.slow),
    pytest.param("plugins.py", ["--quick"], None, id="plugins", marks=pytest.mark.slow),
    pytest.param("decode.py", ["--smoke"], None, id="decode", marks=pytest.mark.slow),
    pytest.param("build.py", ["--smoke"], "checkpoint_growth_x", id="build", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("script, args, key", SMOKE_RUNS)
def test_benchmark_smoke(script, args, key, tmp_path):
    fig = run_smoke(script, *args, tmp_path=tmp_path)
    assert fig and (key is None or key in fig), sorted(fig)

"""Every benchmark script runs in its smoke mode (tiny sizes, seconds) in the default suite, so a change to the
runtime's contracts cannot leave a benchmark broken unseen. Scripts with their own tests elsewhere:
`gpu_check.sh` and its steps (test_gpu_check.py, test_dp_decode_model.py), `gpu_rank_step.py` and
`gpu_torch_check.sh` (test_torch_backend.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_smoke(script: str, *args: str, tmp_path: Path) -> dict:
    """Run `benchmarks/<script> <args> --json out`; its figures."""
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(out.read_text())


def test_host_overhead_smoke(tmp_path):
    """The host-overhead benchmark drives `LLM`'s core over its instant runner (the runner contract it mocks must
    keep up with the real one: it broke once on `dp_layout`)."""
    fig = run_smoke("host_overhead.py", "--smoke", tmp_path=tmp_path)
    for key in ("host_ms_per_step_1", "host_ms_per_step_4", "serial_ms_per_step_256", "overlap_ms_per_step_256",
                "sampler_ms_4_greedy", "sampler_ms_4_sampled_peaked"):
        assert fig[key] > 0, key

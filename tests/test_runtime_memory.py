"""Engine memory over a long prefill: what a step allocates is released when it ends (in a fresh process,
so RSS is this engine's alone; glibc's free pages are trimmed before each reading)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, sys
import psutil
from moe_export.runtime.engine import Engine
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.scheduler import Request, Scheduler

eng = Engine(sys.argv[1], num_slots=1, threads=1)
sched = Scheduler(eng, keep_sessions=False)
sched.add(Request("long", [1 + i % 500 for i in range(int(sys.argv[2]))], SamplingParams(max_tokens=1, ignore_eos=True)))
libc, proc, rss = ctypes.CDLL("libc.so.6"), psutil.Process(), []
while sched.has_work:
    sched.step()
    libc.malloc_trim(0)
    rss.append(proc.memory_info().rss)
print(json.dumps(rss))
"""


def probe_rss(engine_dir, prompt_len: int) -> list[int]:
    """RSS (bytes) after each scheduler step of one `prompt_len`-token prompt, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(engine_dir), str(prompt_len)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_long_prefill_steps_hold_no_memory_after_they_end(runtime_engine):
    """1,000 prompt tokens in 16 chunks of 64 (tiny-k3, 4 ranks in process: 12 MLA segment sessions). Each chunk's
    attention temporaries grow with its context (up to 64 x 1,024 positions x 40 fp32 values, ~50-70 MB live per op);
    with per-session ORT arenas every MLA session kept its high-water mark and RSS grew ~800 MB over the steps."""
    rss = probe_rss(runtime_engine("tiny-k3", 2, 2, 4), 1000)
    assert len(rss) == 16
    held = rss[-1] - rss[1]
    assert held < 48e6, f"RSS grew {held / 1e6:.0f} MB from the 2nd to the last chunk: {[round(r / 1e6) for r in rss]}"

"""Engine memory over a long prefill: what a step allocates is released when it ends, a step's peak does not grow
with tokens x context (the attention bodies stream over key tiles), and steps reuse the heap instead of faulting in
fresh pages. Measured in a fresh process, so RSS is this engine's alone;
glibc's free pages are trimmed before each reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


PROBE = r"""
import ctypes, json, re, sys
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.sampling import SamplingParams


def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


eng = Engine(sys.argv[1], num_slots=1, threads=1, max_step_pairs=int(sys.argv[3]) or None)
sched = EngineCore(eng, keep_sessions=False, prefix_caching=False)  # chunks of max_num_tokens, none cut at checkpoints
one = SamplingParams(max_tokens=1, ignore_eos=True)
sched.add(Request("warm-up", [1, 2, 3], one))
while sched.has_work:
    sched.step()
libc = ctypes.CDLL("libc.so.6")
libc.malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
start = status("VmRSS")
sched.add(Request("long", [1 + i % 500 for i in range(int(sys.argv[2]))], one))
held = []
while sched.has_work:
    sched.step()
    libc.malloc_trim(0)  # hand freed heap pages back: RSS shows what is still held
    held.append(status("VmRSS") - start)
print(json.dumps({"held": held, "peak": status("VmHWM") - start}))
"""


def probe(engine_dir, prompt_len: int, max_step_pairs: int | None = None) -> dict:
    """In a fresh process, after a warm-up request: one `prompt_len`-token prompt through the scheduler.
    -> {"held": RSS growth after each step, "peak": peak RSS growth} (bytes)."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(engine_dir), str(prompt_len), str(max_step_pairs or 0)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_long_prefill_steps_hold_no_memory_after_they_end(runtime_engine):
    """1,000 prompt tokens in 16 chunks of 64 (tiny-k3, 4 ranks in process: 12 MLA segment sessions). Each chunk's
    attention temporaries grow with its context (up to 64 tokens x 1,024 positions: tens of MB per op); with
    per-session ORT arenas every MLA session kept its high-water mark and RSS grew ~800 MB over the steps."""
    held = probe(runtime_engine("tiny-k3", 2, 2, 4), 1000)["held"]
    assert len(held) == 16
    assert held[-1] - held[1] < 48e6, f"RSS grew from the 2nd to the last chunk: {[round(h / 1e6) for h in held]} MB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_long_prompt_in_one_step_peaks_at_the_key_tiles(runtime_engine):
    """1,000 prompt tokens in one step (1,024 tokens per step allowed; tiny-k3, world 1): the dense attention body
    streams over key tiles of TILE_ELEMS floats (8 MB) and scores the chunk's own rows once ([1,000, 4 heads, 1,000]
    fp32: 16 MB, a few live at once), so the step peaks at ~140 MB (measured) with the other layers' temporaries;
    before, the body held [1,000, 1,008, 40] rows several times over: ~1 GB (and a pair budget cut the prompt into 9
    chunks to stay near 150 MB). Bound: a quarter of the old peak."""
    got = probe(runtime_engine("tiny-k3", 1, 1, 1, max_num_tokens=1024), 1000)
    assert len(got["held"]) == 1
    assert got["peak"] < 250e6, f"peak {got['peak'] / 1e6:.0f} MB"


FAULTS = r"""
import json, resource, sys
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine

eng = Engine(sys.argv[1], num_slots=1, threads=1)
tokens = [1 + i % 400 for i in range(192)]


def step():  # a 192-token prompt in one step: attention temporaries of MBs ([192, 192, D] per op)
    eng.reset_slot(0)
    eng.step(StepBatch.from_sequences([SequenceChunk(0, 0, tokens, list(range(12)))], eng.image_width))


step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and the minor-fault count (resource.getrusage) are glibc-on-Linux behaviour; CI runs Linux")
def test_steps_reuse_the_heap_instead_of_faulting_in_fresh_pages(runtime_engine):
    """One 192-token prefill step, ten times after two warm-up ones (tiny-k3, 4 ranks in process): with
    `keep_step_memory`'s thresholds the temporaries come from the heap the previous step freed (measured: 74-476
    minor page faults per step); with glibc's adaptive defaults each step faulted its MBs back in (measured:
    15,000-29,000 per step)."""
    out = subprocess.run([sys.executable, "-c", FAULTS, str(runtime_engine("tiny-k3", 2, 2, 4, max_num_tokens=512))],
                         capture_output=True,
                         text=True, timeout=600, env={k: v for k, v in os.environ.items()
                                                      if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"})
    assert out.returncode == 0, out.stderr
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    assert faults < 3000, f"{faults:.0f} minor page faults per step"


@pytest.mark.slow  # 20-42 s on 2 cores: the default run stays under 20 minutes
def test_long_context_benchmark_smoke(tmp_path):
    """`benchmarks/long_context.py --smoke` (tiny-k3-dsa, 512 and 2,048 tokens; the tiled-cache decode, the
    model-free host points and the indexer's share of a prefill step too): every key of each point, and every
    prefill step but the last (and the one ending at the prompt's last block boundary, a prefix-cache checkpoint)
    has max_num_tokens tokens."""
    out = tmp_path / "long.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks/long_context.py"), "--smoke",
                    "--work", str(tmp_path / "work"), "--json", str(out)], check=True, capture_output=True, timeout=600)
    got = json.loads(out.read_text())
    assert got["smoke"] is True and len(got["loadavg_before"]) == 3
    for context, point in got["points"]["tiny-k3-dsa"].items():
        assert point["prefill_s"] > 0 and point["prefilled_tokens"] == int(context), point
        assert point["short_prefill_steps"] == 0, point
        assert point["decode_ms_per_token"] > 0 and point["host_ms_per_step"] > 0 and point["peak_rss_mb"] >= 0
        assert min(point["decode_ms_per_token_tiled_cache"]) > 0 and got["host_instant"][context]["host_ms_per_step_instant"] > 0
        for kind, tokens in (("prefill", 512), ("decode", 1)):
            profile = got[f"{kind}_profile"]["tiny-k3-dsa"][context]
            assert profile["step_tokens"] == tokens and profile["indexer_layers"] == 2, profile
            assert profile["rest_cpu_ms"] > 0 and profile["indexer_alone_cpu_gflop_per_s"] > 0, profile
    for kind in ("prefill", "decode"):
        assert set(got[f"{kind}_profile"]["tiny-k3-dsa"]["growth_2048_over_512"]) == {
            f"{t}{unit}_ms" for t in ("step", "indexer", "rest", "indexer_alone") for unit in ("", "_cpu")}
    assert {f"{m}_tiny-k3-dsa_2048_over_512" for m in ("host_ms", "host_cpu_ms", "decode", "decode_cpu", "decode_tiled",
                                                       "decode_cpu_tiled", "decode_cpu_least_tiled")} | {
        f"{m}_2048_over_512" for m in ("host_ms_per_step_instant", "host_cpu_ms_per_step_instant",
                                       "host_cpu_ms_per_step_instant_least")} == set(got["ratios"])

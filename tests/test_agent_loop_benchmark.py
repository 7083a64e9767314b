"""`benchmarks/agent_loop.py --smoke`: 3 rounds of the forced-tool agent loop through the official `openai` client's
Responses API against `moe-export serve`, with a restart after round 2 (seconds)."""

from __future__ import annotations

import json
import subprocess
import pytest
import sys
from pathlib import Path


@pytest.mark.slow  # 20-42 s on 2 cores: the default run stays under 20 minutes
def test_agent_loop_benchmark_smoke(tmp_path):
    out = tmp_path / "agent.json"
    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks/agent_loop.py"), "--smoke",
                          "--work", str(tmp_path / "work"), "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["smoke"] is True and len(got["loadavg_before"]) == 3 and list(got["runs"]) == ["responses/named"]
    loop = got["runs"]["responses/named"]
    rounds = loop["rounds"]
    assert len(rounds) == 3
    for prev, cur in zip(rounds, rounds[1:]):
        assert cur["uncached"] == cur["input"] - cur["cached"]
        assert cur["new"] == cur["input"] - prev["input"] and cur["ideal"] == cur["new"] - prev["output"]
        # the tool's answer (100-300 tokens) and the model's previous output are both part of the growth
        assert cur["ideal"] >= 100
    assert rounds[1]["cached"] > 0  # round 2 continues a kept session on the same server
    restart = loop["restart"]
    # the server without prefix caching prefilled the same prompt: the whole chain, read back from the store
    assert restart["round"] == 3 and restart["reprefill_uncached"] == rounds[2]["input"]
    assert restart["restart_ttft_over_reprefill"] > 0 and isinstance(restart["met"], bool)
    # measured as two interleaved pairs, each server on a fresh copy of the store: no attempt sees another's state
    pairs = restart["pairs"]
    assert len(pairs) == 2 and all(p["reprefill_uncached"] == rounds[2]["input"] for p in pairs)
    assert all(p["restart_uncached"] == rounds[2]["uncached"] for p in pairs)
    # the restarted server loads the chain's state offloaded next to the store (`runtime.core.state_offload`): only
    # the tool's answer and the framing around it are prefilled
    assert rounds[2]["cached"] > 0 and restart["restart_uncached"] == rounds[2]["uncached"] < rounds[2]["ideal"] * 1.2
    assert "responses/named" in run.stdout and ("met" in run.stdout) and "warm turns on" in run.stdout
    # named tool choice: the next prompt continues the kept session, no warm turn is needed
    assert got["warm_turns"] is True and all(r["warm"] == 0 for r in rounds)

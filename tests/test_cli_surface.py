"""What a new user sees of the command line: help pages (boolean flags as flags, every synth preset), the
generate prompt requirement, and `serve`'s line per request."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import run_cli

COMMANDS = ("plan", "synth", "inspect", "generate", "chat", "build", "verify", "triton-repo", "batch", "eval", "serve")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_boolean_flags_are_shown_as_flags(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(capsys, *([command] if command else []), "--help")
    assert code == 0 and "--help" in out
    assert "<bool>" not in out, out
    if command == "serve":  # a flag's row: the flag, then its help, no value type between them
        assert re.search(r"--allow-image-urls\s+K3 engines", out), out


def test_synth_help_lists_every_preset(capsys, monkeypatch):
    from moe_export.export.convert.synth import PRESETS

    monkeypatch.setenv("COLUMNS", "200")
    _, out, _ = run_cli(capsys, "synth", "--help")
    text = " ".join(out.replace("│", " ").split())
    assert all(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in PRESETS), (list(PRESETS), text)


def test_generate_says_a_prompt_is_required(capsys, tmp_path):
    from conftest import write_engine_config

    write_engine_config(tmp_path)
    code, _, err = run_cli(capsys, "generate", str(tmp_path), "--max-new-tokens", "2")
    assert code == 2 and "give exactly one of --prompt-ids 1,2,3 (token ids) or --prompt TEXT" in err, err


SERVER_OVER_A_FAKE_ENGINE = """
import sys
sys.path.insert(0, sys.argv[1])
from fake_llm import FakeLLM
import moe_export.runtime.client.async_llm as llm_module

llm_module.AsyncLLM = lambda *args, **kwargs: FakeLLM()
from moe_export.runtime.entrypoints.cli import main
sys.argv = ["moe-export", "serve", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_serve_logs_one_line_per_request(tmp_path, quiet):
    from conftest import write_engine_config
    from serve_support import free_port, stop_process, wait_ready

    write_engine_config(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-c", SERVER_OVER_A_FAKE_ENGINE, str(Path(__file__).parent), str(tmp_path),
           "--port", str(port), *(["--no-access-log"] if quiet else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "nope", "messages": []})
        assert r.status_code == 404
        assert stop_process(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    lines = [line for line in out.splitlines() if '"POST /v1/chat/completions HTTP/1.1" 404' in line]
    assert len(lines) == (0 if quiet else 1), out
    assert quiet or re.search(r'"GET /health HTTP/1.1" 200', out), out

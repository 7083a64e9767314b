"""`moe-export build` end to end with the real stages: the shipped tiny-cpu recipe (synthetic tiny-k3,
4 CPU ranks, tp=2, ep=2, ONNX Runtime backend) into a temporary folder, then verify and inspect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import yaml
from conftest import run_cli
from moe_export.common.manifest import INTERNAL_DIRS, artifact_files
from moe_export.plugins.registry import register_all_schemas
from moe_export.recipes import recipes_dir


def test_tiny_cpu_build_verify_inspect_rerun(tmp_path, capsys):
    out = tmp_path / "tiny-cpu"
    recipe = str(recipes_dir() / "tiny-cpu.yaml")
    code, stdout, err = run_cli(capsys, "build", "--recipe", recipe, "--out", str(out))
    assert code == 0, err
    assert "ran convert x4" in stdout

    files = artifact_files(out)
    assert {"config.json", "LICENSE", "tiktoken.model", "tokenizer_config.json"} <= set(files)
    for n in range(4):
        for name in ("weights.safetensors", "quantization.json", "model.onnx"):
            assert f"rank{n}/{name}" in files
        assert any(f.startswith(f"rank{n}/ort_segment_") for f in files)
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["files"]) == files
    assert manifest["source"] == {**manifest["source"], "kind": "synthetic", "preset": "tiny-k3", "seed": 0}
    assert manifest["quantization"]["quantized_tensors"] > 0

    code, stdout, err = run_cli(capsys, "verify", str(out))
    assert code == 0, err

    # what users run on the artifacts: onnx.checker follows the external data into weights.safetensors
    # and refuses a file with more than one hard link
    register_all_schemas()
    onnx.checker.check_model(str(out / "rank0" / "model.onnx"), full_check=True)
    links = {}
    for dirpath, dirnames, filenames in os.walk(out):
        if Path(dirpath) == out:
            dirnames[:] = [d for d in dirnames if d not in INTERNAL_DIRS]
        links.update({os.path.join(dirpath, f): os.stat(os.path.join(dirpath, f)).st_nlink for f in filenames})
    assert len(links) == len(files) + 1 and set(links.values()) == {1}, links

    # the engine directory carries the tokenizer, so text prompts work on it
    code, stdout, err = run_cli(capsys, "generate", str(out), "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    assert code == 0, err
    tokens = json.loads(stdout)["tokens"]
    assert len(tokens) == 4 and all(isinstance(t, int) for t in tokens)

    code, stdout, err = run_cli(capsys, "inspect", str(out), "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["kind"] == "engine" and report["num_ranks"] == 4 and report["manifest"]["ok"]
    for rank in report["ranks"]:
        assert rank["graph"]["plugin_nodes"], "the rank graph has no moe_export plugin nodes"
        assert rank["graph"]["external_data"] == ["weights.safetensors"]
        classes = rank["weights"]["classes"]
        assert {"embeddings", "kda", "mla", "routed_experts"} <= set(classes)

    code, stdout, err = run_cli(capsys, "build", "--recipe", recipe, "--out", str(out))
    assert code == 0, err
    assert "up to date: nothing to do" in stdout

    # a thinking budget is only echoed in config.json: nothing else is rebuilt
    data = yaml.safe_load(Path(recipe).read_text())
    data["thinking"]["high"] = 300
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(data))
    code, stdout, err = run_cli(capsys, "build", "--recipe", str(changed), "--out", str(out))
    assert code == 0, err
    assert stdout.startswith("ran config;")
    assert json.loads((out / "config.json").read_text())["thinking"]["high"] == 300
    code, stdout, err = run_cli(capsys, "verify", str(out))
    assert code == 0, err


def test_mpi_build_matches_serial_build_byte_for_byte(tmp_path, capsys):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    assert mpiexec.is_file(), "mpiexec (mpich, in the test extra) is not installed in the environment"
    recipe = str(recipes_dir() / "tiny-cpu.yaml")
    serial, parallel = tmp_path / "serial", tmp_path / "mpi"
    code, _, err = run_cli(capsys, "build", "--recipe", recipe, "--out", str(serial))
    assert code == 0, err
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", str(Path(sys.executable).parent / "moe-export"), "build", "--recipe", recipe,
         "--out", str(parallel)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    files = artifact_files(serial)
    assert artifact_files(parallel) == files
    for rel in files:
        assert (serial / rel).read_bytes() == (parallel / rel).read_bytes(), rel

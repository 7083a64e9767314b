"""Manifest, verify and inspect of engine directories; atomic write helpers."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from moe_export.common.atomic import (
    atomic_path,
    atomic_write_json,
    canonical_json,
    sweep_temporaries,
    temp_path,
)
from moe_export.common.errors import InputError
from moe_export.common.manifest import (
    is_engine_dir,
    load_manifest,
    quantization_summary,
    verify_engine_dir,
)
from moe_export.export.build import build
from moe_export.export.convert.checkpoint import read_safetensors_header
from moe_export.export.build.inspect_engine import inspect_engine

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_cli, write_engine_config
from test_build_driver import FAKE_STAGES, tiny_recipe  # noqa: E402


@pytest.fixture()
def engine(tmp_path, synthetic_checkpoint) -> Path:
    out = tmp_path / "engine"
    build(tiny_recipe(synthetic_checkpoint("tiny-k3")), out, stages=FAKE_STAGES, progress=False)
    return out


# ---- atomic helpers ----
def test_canonical_json_is_sorted_and_spells_nonfinite_floats():
    a = canonical_json({"b": 1, "a": [math.inf, -math.inf, math.nan, 1.5]})
    assert a == canonical_json({"a": [math.inf, -math.inf, math.nan, 1.5], "b": 1})
    assert json.loads(a) == {"a": ["inf", "-inf", "nan", 1.5], "b": 1}


def test_atomic_path_keeps_the_old_file_on_failure_and_sweep_removes_leftovers(tmp_path):
    target = tmp_path / "f.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
    leftover = temp_path(tmp_path / "sub" / "w.bin")
    leftover.parent.mkdir()
    leftover.write_bytes(b"x")
    (tmp_path / "sub" / ".scratch.tmp-12").mkdir()
    assert len(sweep_temporaries(tmp_path)) == 2
    assert list((tmp_path / "sub").iterdir()) == []


def test_quantization_summary_worst_case_over_ranks():
    reports = {
        0: {"tensors": [{"name": "a", "sqnr_db": 30.0, "max_abs_err": 0.1}, {"name": "b", "sqnr_db": None}],
            "summary": {"n": 2}},
        1: {"tensors": [{"name": "a", "sqnr_db": 25.0, "max_abs_err": 0.05}], "summary": {"n": 1}},
    }
    s = quantization_summary(reports)
    assert s["quantized_tensors"] == 3
    assert (s["min_sqnr_db"], s["min_sqnr_tensor"], s["max_abs_err"]) == (25.0, "rank1/a", 0.1)
    assert s["per_rank"] == {"rank0": {"n": 2}, "rank1": {"n": 1}}


# ---- verify ----
def test_verify_clean_and_every_kind_of_problem(engine, capsys):
    assert verify_engine_dir(engine)["ok"]
    code, out, _ = run_cli(capsys, "verify", str(engine))
    assert code == 0 and "match the manifest" in out

    onnx_file = engine / "rank0" / "model.onnx"
    data = bytearray(onnx_file.read_bytes())
    data[-1] ^= 0xFF
    os.unlink(onnx_file)  # break the hard link so the staged copy stays intact
    onnx_file.write_bytes(bytes(data))
    weights = engine / "rank1" / "weights.safetensors"
    truncated = weights.read_bytes()[:-10]
    os.unlink(weights)
    weights.write_bytes(truncated)
    (engine / "LICENSE").unlink()
    (engine / "rank2" / "notes.txt").write_text("extra")
    (engine / ".cache" / "scratch").write_text("internal, ignored")

    report = verify_engine_dir(engine)
    assert not report["ok"]
    assert report["missing"] == ["LICENSE"]
    assert {a["file"]: a["reason"].split()[0] for a in report["altered"]} == {
        "rank0/model.onnx": "sha256", "rank1/weights.safetensors": "size"}
    assert report["extra"] == ["rank2/notes.txt"]
    code, out, err = run_cli(capsys, "verify", str(engine))
    assert code == 2
    assert "missing: LICENSE" in out and "altered: rank0/model.onnx" in out and "extra: rank2/notes.txt" in out
    assert "1 missing, 2 altered, 1 extra" in err and "Traceback" not in err
    code, out, _ = run_cli(capsys, "verify", str(engine), "--json")
    assert code == 2 and json.loads(out)["extra"] == ["rank2/notes.txt"]


def test_verify_without_manifest_is_input_error(tmp_path, capsys):
    with pytest.raises(InputError, match="no manifest.json"):
        load_manifest(tmp_path)
    code, _, err = run_cli(capsys, "verify", str(tmp_path))
    assert code == 2 and "no manifest.json" in err


# ---- inspect ----
def test_inspect_engine_reports_graphs_weights_and_manifest(engine):
    report = inspect_engine(engine)
    assert report["kind"] == "engine" and report["backend"] == "onnxruntime"
    assert report["mapping"] == {"world_size": 4, "tp_size": 2, "ep_size": 2, "attention": "tp"}
    assert report["num_ranks"] == 4
    assert report["manifest"]["present"] and report["manifest"]["ok"]
    r1 = report["ranks"][1]
    assert r1["mapping"]["ep_rank"] == 1 and r1["mapping"]["tp_rank"] == 1
    g = r1["graph"]
    assert g["op_counts"] == {"Cast": 1, "Gather": 1, "moe_export::AllReduce": 1, "moe_export::SparseMLAAttention": 1}
    assert g["plugin_nodes"] == {"moe_export::AllReduce": 1, "moe_export::SparseMLAAttention": 1}
    assert g["external_data"] == ["weights.safetensors"]
    assert r1["ort_segments"] == ["ort_segment_000.onnx"] and r1["engine"] == []
    w = r1["weights"]
    tensors, _ = read_safetensors_header(engine / "rank1" / "weights.safetensors")
    assert w["tensors"] == len(tensors) and w["bytes"] == sum(t.nbytes for t in tensors)
    assert set(w["classes"]) == {"embeddings", "norms", "dense", "routed_experts"}
    # rank 1 holds experts 4..7 of the first MoE layer: 4 experts x 3 weights x (packed + scale)
    assert w["classes"]["routed_experts"]["tensors"] == 24
    experts = {int(t.name.split(".experts.")[1].split(".")[0]) for t in tensors if ".experts." in t.name}
    assert experts == {4, 5, 6, 7}


def test_inspect_cli_dispatches_engine_and_checkpoint(engine, synthetic_checkpoint, capsys):
    code, out, err = run_cli(capsys, "inspect", str(engine), "--json")
    assert code == 0, err
    assert json.loads(out)["kind"] == "engine"
    code, out, err = run_cli(capsys, "inspect", str(engine))
    assert code == 0, err
    assert "weights by class" in out and "SparseMLAAttention x1" in out
    code, out, err = run_cli(capsys, "inspect", str(synthetic_checkpoint("tiny-k3")), "--json")
    assert code == 0, err
    assert json.loads(out)["kind"] == "checkpoint"


def test_is_engine_dir(engine, synthetic_checkpoint, tmp_path):
    assert is_engine_dir(engine)
    assert not is_engine_dir(synthetic_checkpoint("tiny-k3"))
    partial = tmp_path / "partial"
    partial.mkdir()
    write_engine_config(partial)  # the build writes config.json before any rank's files
    assert is_engine_dir(partial)
    assert inspect_engine(partial)["manifest"] == {"present": False, "ok": False}

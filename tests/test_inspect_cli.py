"""`moe-export synth` and `moe-export inspect` through the CLI entry point."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter

import pytest

from moe_export.runtime.entrypoints.cli import main
from moe_export.export.convert.synth import SMALL_PRESETS, preset_config, synthetic_specs
from conftest import run_cli




@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """preset -> checkpoint directory written by `moe-export synth` (seed 5)."""
    root = tmp_path_factory.mktemp("cli")
    out = {}
    for preset in SMALL_PRESETS:
        sys.argv, old = ["moe-export", "synth", "--preset", preset, "--out", str(root / preset), "--seed", "5"], sys.argv
        try:
            with pytest.raises(SystemExit) as exc:
                main()
        finally:
            sys.argv = old
        assert exc.value.code == 0
        out[preset] = root / preset
    return out


@pytest.mark.parametrize("preset", SMALL_PRESETS)
def test_inspect_json_matches_inventory(made, preset, capsys):
    code, out, err = run_cli(capsys, "inspect", str(made[preset]), "--json")
    assert code == 0, err
    report = json.loads(out)
    cfg = preset_config(preset)
    specs = synthetic_specs(cfg)
    tensors, nbytes = Counter(), Counter()
    for s in specs:
        tensors[s.weight_class] += 1
        nbytes[s.weight_class] += s.nbytes
    assert report["kind"] == "checkpoint"
    assert report["architecture"] == cfg.architecture
    assert report["model_type"] == cfg.model_type
    assert report["num_tensors"] == len(specs)
    assert report["total_bytes"] == sum(s.nbytes for s in specs)
    assert report["classes"] == {c: {"tensors": tensors[c], "bytes": nbytes[c]} for c in tensors}
    assert report["problems"] == []
    assert report["layers"]["mla"] == list(cfg.mla_layers)
    assert report["layers"]["kda"] == list(cfg.kda_layers)


def test_inspect_human_output(made, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(made["tiny-k3-dsa"]))
    assert code == 0
    for needle in ("Kimi K3 + DSA indexer", "routed experts", "latent projections", "vision", "DSA indexer: top-4",
                   "no problems found"):
        assert needle in out, needle


def test_inspect_with_problems_still_reports_census(made, tmp_path, capsys):
    root = shutil.copytree(made["tiny-k3"], tmp_path / "broken")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    emb = "language_model.model.embed_tokens.weight"
    (root / index["weight_map"][emb]).unlink()
    code, out, err = run_cli(capsys, "inspect", str(root), "--json")
    assert code == 2
    report = json.loads(out)  # stdout stays pure JSON
    assert [p["kind"] for p in report["problems"]] == ["missing_shard"]
    assert report["problems"][0]["file"] == index["weight_map"][emb]
    assert report["num_tensors"] > 0 and "routed_experts" in report["classes"]
    assert "missing_shard" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "inspect", str(root))
    assert code == 2 and "routed experts" in out and "1 problem(s) found" in out
    assert index["weight_map"][emb] in err


def test_synth_refuses_non_empty_and_unknown_preset(made, tmp_path, capsys):
    code, _, err = run_cli(capsys, "synth", "--preset", "tiny-kimi-linear", "--out", str(made["tiny-kimi-linear"]))
    assert code == 2 and "not empty" in err and "--force" in err
    code, _, err = run_cli(capsys, "synth", "--preset", "kimi-k9", "--out", str(tmp_path / "k9"))
    assert code == 2 and "kimi-k9" in err and "tiny-k3, tiny-k3-dsa, tiny-kimi-linear" in err
    assert not (tmp_path / "k9").exists()
    code, out, _ = run_cli(capsys, "synth", "--preset", "tiny-kimi-linear", "--out", str(tmp_path / "kl"), "--force")
    assert code == 0 and "tiny-kimi-linear" in out


def test_inspect_not_a_checkpoint(tmp_path, capsys):
    code, _, err = run_cli(capsys, "inspect", str(tmp_path / "nowhere"))
    assert code == 2 and "not a checkpoint directory" in err
    code, _, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 2 and "no config.json" in err

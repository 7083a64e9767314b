"""`EngineConfig`: the one reader and writer of an engine's config.json. A round trip keeps every field; a
missing, mistyped, unknown or inconsistent field is an InputError naming it; nothing in runtime/ reads
config.json past it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import write_engine_config
from moe_export.common.engine_config import (
    CONFIG,
    ENGINE_FORMAT,
    EngineConfig,
    is_engine_config,
)
from moe_export.common.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip(tmp_path):
    cfg = write_engine_config(tmp_path, "tensorrt")
    back = EngineConfig.read(tmp_path)
    assert back == cfg and back.to_dict() == cfg.to_dict()
    raw = json.loads((tmp_path / CONFIG).read_text())
    assert raw["format"] == ENGINE_FORMAT and raw["backend"] == "tensorrt" == back.backend
    assert raw["limits"] == back.recipe.limits.model_dump(mode="json")
    assert back.mapping.world_size == len(back.ranks) == 4 and (back.mapping.tp, back.mapping.ep) == (2, 2)
    assert back.thinking == raw["thinking"] and back.model.vocab_size == raw["pretrained_config"]["text_config"]["vocab_size"]
    assert is_engine_config(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.backend = "onnxruntime"  # frozen


def _rewrite(folder: Path, edit) -> None:
    raw = json.loads((folder / CONFIG).read_text())
    edit(raw)
    (folder / CONFIG).write_text(json.dumps(raw))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("recipe"), "missing field 'recipe'"),
    (lambda d: d.pop("eos_token_ids"), "missing field 'eos_token_ids'"),
    (lambda d: d.update(pretrained_config=[1]), "field 'pretrained_config' must be an object"),
    (lambda d: d.update(eos_token_ids=["x"]), "field 'eos_token_ids' must be a list of token ids"),
    (lambda d: d.update(format="moe-export-engine/0"), "field 'format' is 'moe-export-engine/0'"),
    (lambda d: d.update(extra_key=1), "unknown field(s) 'extra_key'"),
    (lambda d: d["recipe"]["limits"].update(max_batch=0), "field 'recipe.limits.max_batch'"),
    (lambda d: d["limits"].update(max_batch=3), "field 'limits' disagrees with the recipe"),
    (lambda d: d["mapping"].update(tp_size=4), "field 'mapping' disagrees with the recipe"),
    (lambda d: d.update(backend="tensorrt"), "field 'backend' disagrees with the recipe"),
    (lambda d: d.update(ranks=[{}]), "field 'ranks' must hold one mapping object per rank"),
    (lambda d: d["pretrained_config"]["text_config"].pop("hidden_size"), "field 'pretrained_config'"),
])
def test_bad_field_is_named(tmp_path, edit, message):
    write_engine_config(tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(InputError, match=re.escape(message)):
        EngineConfig.read(tmp_path)


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(InputError, match="not an engine directory"):
        EngineConfig.read(tmp_path)
    (tmp_path / CONFIG).write_text("{nope")
    with pytest.raises(InputError, match="not valid JSON"):
        EngineConfig.read(tmp_path)
    (tmp_path / CONFIG).write_text("[]")
    with pytest.raises(InputError, match="expected a JSON object"):
        EngineConfig.read(tmp_path)
    (tmp_path / CONFIG).write_text(json.dumps({"model_type": "kimi_k3"}))  # a checkpoint's HF config
    assert not is_engine_config(tmp_path)


def test_entry_points_refuse_a_bad_config_with_its_field(tmp_path, capsys):
    """serve, triton-repo and batch check the engine's config.json through EngineConfig before anything else."""
    from conftest import run_cli

    write_engine_config(tmp_path)
    _rewrite(tmp_path, lambda d: d.pop("weight_classes"))
    (tmp_path / "in.jsonl").write_text("")
    for args in (["serve", str(tmp_path)], ["triton-repo", str(tmp_path), "--out", str(tmp_path / "repo")],
                 ["batch", str(tmp_path), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")],
                 ["generate", str(tmp_path), "--prompt-ids", "1", "--max-new-tokens", "1"]):
        code, _, err = run_cli(capsys, *args)
        assert code == 2 and "missing field 'weight_classes'" in err and "Traceback" not in err, (args, err)


def test_runtime_reads_config_json_only_through_engine_config():
    """No module of the runtime names the engine's config.json (they all take an EngineConfig)."""
    pattern = re.compile(r"""["']config\.json["']""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "runtime").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []

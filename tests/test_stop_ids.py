"""Stop ids: every eos id of config.json (a list too) and of generation_config.json is kept, the
generation config travels into the engine folder, and `generate` stops at any of them (also on an engine built
from a checkpoint without tokenizer files: token ids need no tokenizer)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import run_cli
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.model_config import ModelConfig
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.runtime.entrypoints.generate import reference_generate

PROMPT = [5, 17, 99, 3, 250, 42]


def test_eos_lists_are_kept_whole(tmp_path, synthetic_checkpoint):
    src = synthetic_checkpoint("tiny-k3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["eos_token_id"] = cfg["text_config"]["eos_token_id"] = [11, 9]
    parsed = ModelConfig.from_hf_dict(cfg, generation_config={"eos_token_id": [9, 4]})
    assert parsed.eos_token_ids == (11, 9, 4) and parsed.eos_token_id == 11
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (11, 9, 7)


@pytest.fixture(scope="module")
def checkpoint_with_generation_stop(tmp_path_factory, synthetic_checkpoint):
    """A copy of tiny-k3 whose generation_config.json adds, as a second eos id, the token the model
    greedily emits third after PROMPT (config.json keeps its single eos id)."""
    path = tmp_path_factory.mktemp("stop") / "ckpt"
    shutil.copytree(synthetic_checkpoint("tiny-k3"), path)
    tokens = reference_generate(load_model(path), PROMPT, 6, stop_at_eos=False)
    stop = tokens[2]
    assert stop not in tokens[:2]
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, stop]}))
    return path, tokens[:3]


def test_reference_generate_stops_at_generation_config_eos(checkpoint_with_generation_stop, capsys):
    path, want = checkpoint_with_generation_stop
    code, out, err = run_cli(capsys, "generate", str(path), "--prompt-ids", ",".join(map(str, PROMPT)),
                             "--max-new-tokens", "6", "--json")
    assert code == 0, err
    assert json.loads(out) == {"tokens": want}


def test_engine_keeps_generation_config_and_stops_there(checkpoint_with_generation_stop, tmp_path, capsys):
    path, want = checkpoint_with_generation_stop
    base = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    base.update(name="stop-ids", model={"source": str(path)})
    base["target"]["gpus_per_node"] = 1
    base["parallel"] = {"tp": 1, "ep": 1}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(base))
    rec, _ = load_recipe(tmp_path / "r.yaml")
    out_dir = tmp_path / "engine"
    build(rec, out_dir)
    assert (out_dir / "generation_config.json").read_bytes() == (path / "generation_config.json").read_bytes()
    engine_cfg = json.loads((out_dir / "config.json").read_text())
    assert engine_cfg["eos_token_ids"] == json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    code, out, err = run_cli(capsys, "generate", str(out_dir), "--prompt-ids", ",".join(map(str, PROMPT)),
                             "--max-new-tokens", "6", "--json")
    assert code == 0, err
    assert json.loads(out) == {"tokens": want}


def test_engine_without_a_tokenizer_generates_from_token_ids(checkpoint_with_generation_stop, tmp_path, capsys):
    """A checkpoint without tokenizer files builds an engine without one; `generate --prompt-ids` runs on it (the
    engine's stop ids alone) and equals the reference model; a text prompt is refused with a clear message."""
    path, want = checkpoint_with_generation_stop
    bare = tmp_path / "ckpt"
    shutil.copytree(path, bare)
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    base = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    base.update(name="no-tokenizer", model={"source": str(bare)})
    base["target"]["gpus_per_node"] = 1
    base["parallel"] = {"tp": 1, "ep": 1}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(base))
    rec, _ = load_recipe(tmp_path / "r.yaml")
    out_dir = tmp_path / "engine"
    build(rec, out_dir)
    assert not (out_dir / "tiktoken.model").exists() and not (out_dir / "tokenizer.json").exists()
    code, out, err = run_cli(capsys, "generate", str(out_dir), "--prompt-ids", ",".join(map(str, PROMPT)),
                             "--max-new-tokens", "6", "--json")
    assert code == 0, err
    assert json.loads(out) == {"tokens": want}
    code, _, err = run_cli(capsys, "generate", str(out_dir), "--prompt", "Hi", "--max-new-tokens", "2")
    assert code == 2 and "no tokenizer" in err and "Traceback" not in err

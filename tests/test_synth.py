"""Synthetic checkpoints: presets, determinism, layout, values, tokenizer, transformers compatibility."""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from moe_export.common.errors import InputError
from moe_export.export.convert.checkpoint import INDEX_FILE, open_checkpoint
from moe_export.export.convert.synth import (
    SMALL_PRESETS,
    preset_config,
    preset_hf_config,
    synthetic_special_ids,
    synthetic_specs,
    synthetic_vocab_size,
    write_synthetic_checkpoint,
)
from moe_export.quantize.mxfp4 import decode
from moe_export.recipes import models_dir
from moe_export.runtime.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """preset -> checkpoint directory (seed 0), written once for this module."""
    root = tmp_path_factory.mktemp("synth")
    return {p: write_synthetic_checkpoint(p, root / p, seed=0) for p in SMALL_PRESETS}


def file_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("preset", SMALL_PRESETS)
def test_preset_validates_clean(made, preset):
    root = made[preset]
    reader = open_checkpoint(root)  # raises on any problem
    assert set(reader.tensor_names()) == {s.name for s in synthetic_specs(reader.config)}
    names = {p.name for p in root.iterdir()}
    assert {"config.json", INDEX_FILE, "tiktoken.model", "tokenizer_config.json", "LICENSE"} <= names
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 3
    width = 6 if reader.config.model_type == "kimi_k3" else 5
    assert all(re.fullmatch(rf"model-\d{{5}}-of-\d{{{width}}}\.safetensors", s) for s in shards)
    index = json.loads((root / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(reader.nbytes(n) for n in reader.tensor_names())
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_same_seed_same_bytes_other_seed_other_weights(made, tmp_path):
    again = file_bytes(write_synthetic_checkpoint("tiny-k3", tmp_path / "a", seed=0))
    assert again == file_bytes(made["tiny-k3"])
    other = file_bytes(write_synthetic_checkpoint("tiny-k3", tmp_path / "b", seed=1))
    assert other.keys() == again.keys()
    for name in again:
        same = other[name] == again[name]
        assert same == (not name.endswith(".safetensors") and name != "LICENSE"), name


def test_k3_presets_follow_k3_structure():
    shipped = json.loads((models_dir() / "kimi-k3.json").read_text())
    for preset in ("tiny-k3", "tiny-k3-dsa"):
        hf = preset_hf_config(preset)
        extra = set(hf["text_config"]) - set(shipped["text_config"])
        assert extra == (set() if preset == "tiny-k3" else {"index_n_heads", "index_head_dim", "index_topk", "indexer_types"})
        cfg = preset_config(preset)
        n = cfg.num_layers
        assert cfg.weight_prefix == "language_model." and cfg.experts_mxfp4
        assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, n))
        assert {n - 2, n - 1} <= set(cfg.mla_layers) and cfg.kda_layers
        assert len(cfg.snapshot_layers()) >= 2
        assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.mla_use_output_gate
        assert cfg.hidden_act == "situ" and cfg.routed_expert_hidden_size and cfg.latent_moe_use_norm
        assert cfg.num_experts % 4 == 0 and cfg.num_heads % 2 == 0 and cfg.kda_num_heads % 2 == 0
    assert preset_config("tiny-k3-dsa").index_topk == 4


def test_values_are_well_scaled(made):
    reader = open_checkpoint(made["tiny-k3"])
    cfg = reader.config
    nh = cfg.kda_num_heads
    pre = "language_model.model.layers."
    a_log = reader.get(pre + "0.self_attn.A_log")
    assert a_log.dtype == torch.float32 and a_log.shape == (max(cfg.kda_head_dim, nh),)
    assert (a_log[nh:] == 0).all() and (a_log[:nh] >= 0).all() and (a_log[:nh] <= math.log(16)).all()
    for name in ("0.self_attn.q_conv1d.weight", "0.self_attn.dt_bias", "0.self_attn.o_norm.weight",
                 "1.block_sparse_moe.gate.e_score_correction_bias"):
        assert reader.get(pre + name).dtype == torch.float32, name
    norm = reader.get(pre + "3.self_attn.kv_a_layernorm.weight").float()
    assert ((norm > 0.89) & (norm < 1.11)).all()
    e = pre + "2.block_sparse_moe.experts.5.w2."
    w = decode(reader.get(e + "weight_packed"), reader.get(e + "weight_scale"))
    assert w.shape == (cfg.expert_in_dim, cfg.moe_intermediate_size)
    assert 0.8 < w.std().item() * math.sqrt(cfg.moe_intermediate_size) < 1.25
    q = reader.get(pre + "3.self_attn.q_b_proj.weight").float()
    assert 0.9 < q.std().item() * math.sqrt(cfg.q_lora_rank) < 1.1


@pytest.mark.parametrize("preset, family, stop", [("tiny-k3", "k3", "<|end_of_msg|>"), ("tiny-kimi-linear", "k2", "<|im_end|>")])
def test_tokenizer_matches_config(made, preset, family, stop):
    tok = load_tokenizer(made[preset])
    cfg = preset_config(preset)
    assert tok.family == family
    assert tok.vocab_size == synthetic_vocab_size() <= cfg.vocab_size
    assert cfg.vocab_size % 64 == 0
    text = "héllo <|open|>user<|sep|>hi<|im_end|><think>x</think>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("AB") == [65, 66]
    assert tok.token_to_id("[BOS]") == cfg.bos_token_id == synthetic_special_ids(family)["[BOS]"]
    assert tok.token_to_id(stop) == cfg.eos_token_id
    assert tok.token_to_id("[PAD]") == cfg.pad_token_id
    assert cfg.eos_token_id in tok.eos_token_ids
    assert max(ids) < cfg.vocab_size


def test_load_tokenizer_needs_a_tokenizer(tmp_path):
    with pytest.raises(InputError, match="no tokenizer"):
        load_tokenizer(tmp_path)


def test_non_empty_out_dir_needs_force(made, tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(InputError, match="not empty"):
        write_synthetic_checkpoint("tiny-kimi-linear", out)
    assert (out / "keep.txt").exists()
    write_synthetic_checkpoint("tiny-kimi-linear", out, force=True)
    assert file_bytes(out) == file_bytes(made["tiny-kimi-linear"])
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


def test_unknown_preset():
    with pytest.raises(InputError, match="known presets: tiny-k3, tiny-k3-dsa, tiny-kimi-linear"):
        preset_hf_config("huge-k3")


def _hf_modeling(module: str):
    """transformers' modeling module imported with fla hidden (its Triton kernels fail on CPU)."""
    name = f"transformers.models.{module}.modeling_{module}"
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def test_kimi_linear_loads_in_transformers(made):
    hf = _hf_modeling("kimi_linear")
    model, info = hf.KimiLinearForCausalLM.from_pretrained(made["tiny-kimi-linear"], output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tok = load_tokenizer(made["tiny-kimi-linear"])
    ids = torch.tensor([tok.encode("Hello, synthetic world!")])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 3.0  # spread of a few units
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no exact ties


def test_mid_k3_has_k3_widths_and_fits_one_gpu(capsys):
    """mid-k3: K3's real widths with 3 layers (KDA + dense, KDA + MoE, MLA + MoE) and 16 experts; its shipped recipe
    (backend torch, one H200) plans as fitting."""
    from conftest import run_cli

    shipped = json.loads((models_dir() / "kimi-k3.json").read_text())["text_config"]
    cfg = preset_config("mid-k3")
    for key in ("hidden_size", "vocab_size", "moe_intermediate_size", "routed_expert_hidden_size", "intermediate_size",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert getattr(cfg, key) == shipped[key], key
    assert (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.vocab_size) == (7168, 3584, 3072, 163840)
    assert cfg.num_heads == cfg.kda_num_heads == 96 and cfg.latent_cache_dim == 576
    assert [cfg.is_kda(i) for i in range(3)] == [True, True, False] and [cfg.is_moe(i) for i in range(3)] == [False, True, True]
    assert cfg.num_experts == 16 and cfg.experts_mxfp4
    assert 9e9 < sum(s.nbytes for s in synthetic_specs(cfg)) < 12e9
    code, out, err = run_cli(capsys, "plan", "--recipe", "mid-k3-h200.yaml", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["recipe"] == "mid-k3-h200" and plan["fits"]


@pytest.mark.slow
def test_mid_k3_synthesizes(tmp_path):
    """`moe-export synth --preset mid-k3` writes a checkpoint that validates (about 10 GB; the GPU checks use it)."""
    root = write_synthetic_checkpoint("mid-k3", tmp_path / "mid-k3", seed=0)
    reader = open_checkpoint(root)
    assert set(reader.tensor_names()) == {s.name for s in synthetic_specs(reader.config)}
    assert reader.config.hidden_size == 7168 and reader.config.vocab_size == 163840

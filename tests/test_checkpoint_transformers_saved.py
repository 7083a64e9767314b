"""A Kimi Linear checkpoint written by transformers' own `KimiLinearForCausalLM.save_pretrained`, in fp32
and in bf16, is accepted (float dtypes other than the original checkpoints', the `block_sparse_moe.*` spelling
of the dense first layer) and the reference model and a built engine reproduce transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import import_hf
from fp32_reorder import longest_sum, num_layers, reorder_atol
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.synth import preset_hf_config
from moe_export.quantize import mxfp4
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77]


def whole_chunk(eng: Engine, slot: int, start: int, tokens: list[int]) -> SequenceChunk:
    """A chunk of slot `slot` whose block table is blocks slot*per .. of the engine's pool, enough for it."""
    per = eng.num_blocks // eng.num_slots
    need = -(-(start + len(tokens)) // eng.block_size)
    return SequenceChunk(slot, start, tokens, list(range(slot * per, slot * per + need)))


def saved_by_transformers(path: Path, dtype: torch.dtype) -> Path:
    """A random KimiLinearForCausalLM of the tiny-kimi-linear config, linear weights ~ N(0, 1/fan_in) and routed
    experts rounded onto the MXFP4 grid (so the engine's MXFP4 experts are exact), saved in `dtype`."""
    hf_mod = import_hf("kimi_linear")
    cfg = hf_mod.KimiLinearConfig(**preset_hf_config("tiny-kimi-linear"))
    torch.manual_seed(0)
    model = hf_mod.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            if ".experts." in name:
                p.copy_(mxfp4.decode(*mxfp4.encode(p)).to(dtype).float())
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def saved(request, tmp_path_factory):
    dtype = request.param
    path = saved_by_transformers(tmp_path_factory.mktemp("hf") / "ckpt", dtype)
    hf = import_hf("kimi_linear").KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
    return path, dtype, want


def test_checkpoint_validates_and_reports_dtypes(saved):
    path, dtype, _ = saved
    header = json.loads((path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (path / "model.safetensors").read_bytes()[:8], "little")])
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in header  # transformers 5's spelling
    assert "model.layers.0.mlp.gate_proj.weight" not in header
    with open_checkpoint(path) as reader:  # raises on any problem
        report = reader.dtype_report()
        assert reader.get("model.layers.0.mlp.gate_proj.weight").shape == (128, 64)
        a_log = next(n for n in reader.tensor_names() if n.endswith("A_log"))
        assert reader.get(a_log).dtype == torch.float32  # the model's fp32 tensors stay (or become) fp32
    if dtype == torch.float32:
        assert set(report) == {"F32 kept (expected BF16)"}
    else:
        assert set(report) == {"BF16 cast to F32 (expected F32)"}


def test_reference_matches_transformers(saved):
    path, _, want = saved
    ours = load_model(path)
    cache = ours.new_cache(1)
    got = ours.prefill(torch.tensor([PROMPT]), cache)[0, -1].numpy()
    # float32 in other summation orders than transformers'
    np.testing.assert_allclose(got, want, atol=reorder_atol(want, ours.cfg.num_layers, longest_sum(ours.cfg, len(PROMPT))), rtol=0)


def test_engine_matches_transformers(saved, tmp_path):
    path, _, want = saved
    base = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    base.update(name="hf-saved", model={"source": str(path)})
    base["quantization"]["kv_cache"] = "fp32"  # exact cache: the comparison is about the weights
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(base))  # tp=2, ep=2 on 4 ranks
    rec, _ = load_recipe(tmp_path / "r.yaml")
    build(rec, tmp_path / "engine")
    report = json.loads((tmp_path / "engine" / "rank0" / "quantization.json").read_text())
    assert report["source_dtypes"]
    eng = Engine(tmp_path / "engine", num_slots=1, threads=1)
    eng.reset_slot(0)
    got = eng.step(StepBatch.from_sequences([whole_chunk(eng, 0, 0, PROMPT)]))[0]
    # ONNX Runtime's float32 sums in other orders than transformers'
    np.testing.assert_allclose(got, want, atol=reorder_atol(want, num_layers(eng.model_config), eng.max_seq_len), rtol=0)
    assert np.abs(want).max() > 0.5  # logits large enough for the tolerance to mean something

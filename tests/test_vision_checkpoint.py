"""K3's tower in the checkpoint tools: validation of the vision tensors, `inspect`, and the planner's vision terms."""

from __future__ import annotations

import json

import pytest
from moe_export.common.recipe import load_recipe
from moe_export.export.convert.census import inspect_checkpoint
from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.export.plan.planner import (
    image_patch_limit,
    make_plan,
    vision_activation_bytes,
)
from moe_export.export.convert.synth import preset_config, write_synthetic_checkpoint
from moe_export.graphs.vision import vision_config, vision_tensor_specs
from safetensors import safe_open
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint("tiny-k3", tmp_path_factory.mktemp("vis") / "ck")


def test_inspect_reports_tower_and_processor(ckpt, capsys):
    import json

    from conftest import run_cli

    rep = inspect_checkpoint(ckpt)
    vis = rep["vision"]
    assert vis["layers"] == 2 and vis["heads"] == 2 and vis["params"] == 62048 and vis["processor_file"]
    code, out, err = run_cli(capsys, "inspect", str(ckpt), "--json")  # the CLI adds the runtime's processor view
    vis = json.loads(out)["vision"]
    assert code == 0 and vis["processor"]["in_patch_limit"] == 65536 and vis["max_tokens_per_image"] == 16384
    assert rep["classes"]["vision"]["tensors"] == len(vision_tensor_specs(vision_config(preset_config("tiny-k3"))))
    assert not rep["problems"]


def test_a_wrong_vision_tensor_is_a_problem(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "vision_tower.encoder.blocks.1.wo.weight"
    shard = bad / index["weight_map"][name]
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    tensors[name] = tensors[name][:, :8].contiguous()
    save_file(tensors, shard)
    problems = CheckpointReader(bad).validate()
    assert [(p.kind, p.name) for p in problems] == [("shape", name)]


def _recipe(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load_recipe(path)[0]


def test_planner_counts_tower_weights_and_activations(tmp_path):
    base = """name: t
model: {source: synthetic:tiny-k3}
target: {gpu: cpu, nodes: 1, gpus_per_node: 2, memory_gib: 2}
parallel: {tp: 2, ep: 2}
workspace_reserve_gib: 0.25
"""
    r = _recipe(tmp_path, base + "limits: {max_images_per_request: 3, max_image_patches: 1024}\n")
    plan = make_plan(r)
    vc = vision_config(preset_config("tiny-k3"))
    assert plan.per_rank[0].weight_bytes["vision"] == vc.params() * 4  # replicated, fp32 on CPU
    # 2 of the 3 images per rank (tp 2), 1024 patches each; CPU graphs hold one image's scores (2 heads)
    per_row = 2 * 32 + 3 * 32 + 64 + 128 // 4 * 2 + 64 // 4
    assert plan.per_rank[0].vision_activation_bytes == 2 * 1024 * per_row * 4 + 2 * 1024 * 1024 * 4
    assert plan.fits
    too_big = make_plan(_recipe(tmp_path, base + "limits: {max_images_per_request: 1, max_image_patches: 65536}\n"))
    assert not too_big.fits and "vision tower call" in too_big.verdict()
    # without max_image_patches: the largest patch count whose activations fit in the reserve
    auto = _recipe(tmp_path, base + "limits: {max_images_per_request: 1}\n")
    limit = image_patch_limit(preset_config("tiny-k3"), auto)
    reserve = 0.25 * 2**30
    one = 2 * 32 + 3 * 32 + 64 + 128 // 4 * 2 + 64 // 4
    assert limit * one * 4 + 2 * limit * limit * 4 <= reserve < (limit + 1) * one * 4 + 2 * (limit + 1) ** 2 * 4
    assert make_plan(auto).fits
    assert vision_activation_bytes(preset_config("tiny-k3"), _recipe(tmp_path, base + "limits: {max_images_per_request: 0}\n")) == 0
    # TensorRT: the tower graph is fp32 there too (weights folded to fp32); no materialized scores (fused attention)
    gpu = base.replace("gpu: cpu", "gpu: h100").replace("memory_gib: 2", "memory_gib: 8") + "backend: tensorrt\n"
    trt = make_plan(_recipe(tmp_path, gpu + "limits: {max_images_per_request: 3, max_image_patches: 1024}\n"))
    assert trt.per_rank[0].weight_bytes["vision"] == vc.params() * 4
    assert trt.per_rank[0].vision_activation_bytes == 2 * 1024 * per_row * 4


def test_synthetic_checkpoint_with_a_larger_tower(tmp_path):
    """`write_synthetic_checkpoint(vision=...)` (the benchmark's mid-size tower): config and tensors follow the
    new widths; a preset without a tower refuses it."""
    from moe_export.common.errors import InputError

    wide = {"vt_hidden_size": 64, "vt_num_attention_heads": 2, "qkv_hidden_size": 256, "vt_intermediate_size": 96,
            "mm_hidden_size": 64}
    ck = write_synthetic_checkpoint("tiny-k3", tmp_path / "ck", vision=wide)
    rep = inspect_checkpoint(ck)
    assert not rep["problems"] and rep["vision"]["heads"] == 2
    vc = vision_config(CheckpointReader(ck).config)
    assert (vc.hidden_size, vc.num_heads, vc.qkv_hidden_size) == (64, 2, 256)
    name = "vision_tower.encoder.blocks.0.wqkv.weight"
    shard = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(ck / shard), "pt") as f:
        assert tuple(f.get_slice(name).get_shape()) == (768, 64)
    with pytest.raises(InputError, match="no vision tower"):
        write_synthetic_checkpoint("tiny-kimi-linear", tmp_path / "kl", vision=wide)

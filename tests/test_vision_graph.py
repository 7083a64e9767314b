"""The vision tower graph (graphs/vision_export.py) under ONNX Runtime against the fp32 reference: three images
of different sizes packed in one call (one with transparency), per-image attention, both eps settings, and the
build's vision stage (files, manifest, rerun)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from fp32_reorder import vision_reorder_atol
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.synth import write_synthetic_checkpoint
from moe_export.graphs.vision import VISION_NORM_EPS, VisionTower, vision_config
from moe_export.graphs.vision_export import (
    export_vision_graph,
    tower_inputs,
    write_vision_weights,
)
from moe_export.runtime.images import ImageProcessor
from PIL import Image


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint("tiny-k3", tmp_path_factory.mktemp("vg") / "ck")


def images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (90, 70, 4), dtype=np.uint8)
    rgba[..., 3] = np.where(rng.random((90, 70)) < 0.5, 0, rgba[..., 3])  # half the pixels fully transparent
    return [Image.fromarray(rng.integers(0, 256, (100, 150, 3), dtype=np.uint8)), Image.fromarray(rgba, "RGBA"),
            Image.fromarray(rng.integers(0, 256, (30, 420, 3), dtype=np.uint8))]


@pytest.mark.parametrize("eps", ["float32", "bfloat16"])
def test_graph_equals_reference(ckpt, tmp_path, eps):
    with open_checkpoint(ckpt) as reader:
        vc = vision_config(reader.config)
        ref = VisionTower.from_source(reader, vc, eps)
        write_vision_weights(reader, vc, tmp_path / "vision.safetensors")
    export_vision_graph(vc, tmp_path / "vision.safetensors", tmp_path / "vision.onnx", VISION_NORM_EPS[eps])
    onnx.checker.check_model(str(tmp_path / "vision.onnx"), full_check=True)
    sess = ort.InferenceSession(str(tmp_path / "vision.onnx"), providers=["CPUExecutionProvider"])
    preps = [ImageProcessor().preprocess(im) for im in images()]
    grids = [p.plan.grid for p in preps]
    px = np.concatenate([p.pixel_values for p in preps])
    got = sess.run(None, tower_inputs(vc, px, grids))[0]
    want = ref(torch.from_numpy(px), torch.tensor(grids)).numpy()
    assert got.shape == (sum(p.num_tokens for p in preps), vc.text_hidden_size)
    atol = vision_reorder_atol(want, vc, px.shape[0])  # ONNX Runtime's float32 sums in other orders than torch's
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    # packing keeps images apart: each image alone gives its own rows
    start = 0
    for p in preps:
        alone = sess.run(None, tower_inputs(vc, p.pixel_values, [p.plan.grid]))[0]
        np.testing.assert_allclose(alone, got[start:start + p.num_tokens], atol=atol, rtol=0)
        start += p.num_tokens


def test_build_writes_the_vision_stage(tmp_path):
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    recipe, _ = load_recipe("tiny-cpu.yaml")
    recipe = recipe.model_copy(update={"target": recipe.target.model_copy(update={"gpus_per_node": 1}),
                                       "parallel": recipe.parallel.model_copy(update={"tp": 1, "ep": 1})})
    res = build(recipe, tmp_path / "eng", progress=False)
    assert "vision" in res.ran
    import json

    files = json.loads((tmp_path / "eng" / "manifest.json").read_text())["files"]
    assert {"vision.onnx", "vision.safetensors", "preprocessor_config.json"} <= set(files)
    assert build(recipe, tmp_path / "eng", progress=False).up_to_date
    eps_changed = recipe.model_copy(update={"vision": recipe.vision.model_copy(update={"rms_norm_eps": "bfloat16"})})
    assert "vision" in build(eps_changed, tmp_path / "eng", progress=False).ran

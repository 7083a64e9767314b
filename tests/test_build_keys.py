"""Stage keys follow the code each stage runs: editing a source file of a stage (or changing a library
version that shapes its output) reruns that stage and those downstream of it; changing nothing is a no-op.
The package's source folders are copied so the test can edit real files."""

from __future__ import annotations

import shutil

import pytest
from test_build_driver import FAKE_STAGES, tiny_recipe

from moe_export.export.build import stage_keys as keys_mod
from moe_export.export.build import build

RANKS = 4


@pytest.fixture
def code_copy(tmp_path, monkeypatch):
    """Copies of the subpackages STAGE_CODE reads, used as the code roots of the build's keys."""
    roots = {sub: tmp_path / "code" / sub for sub in keys_mod.code_roots()}
    for sub, real in keys_mod.code_roots().items():
        shutil.copytree(real, roots[sub], ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(keys_mod, "code_roots", lambda: roots)
    return roots


def ran_stages(result) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in result.ran:
        counts[name.split("/")[0]] = counts.get(name.split("/")[0], 0) + 1
    return counts


def test_editing_a_stage_source_reruns_that_stage(tmp_path, code_copy, monkeypatch):
    recipe = tiny_recipe("synthetic:tiny-k3")
    out = tmp_path / "engine"
    assert ran_stages(build(recipe, out, stages=FAKE_STAGES, progress=False)) == {
        "convert": RANKS, "graph": RANKS, "lower": RANKS, "config": 1, "license": 1, "tokenizer": 1,
        "vision": 1}
    assert build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date

    with open(code_copy["quantize"] / "mxfp4.py", "a") as f:  # the converter's quantizer
        f.write("\n# edited\n")
    assert ran_stages(build(recipe, out, stages=FAKE_STAGES, progress=False)) == {
        "convert": RANKS, "graph": RANKS, "lower": RANKS, "config": 1}

    with open(code_copy["plugins"] / "moe_mxfp4" / "ort.py", "a") as f:  # an ONNX Runtime plugin function
        f.write("\n# edited\n")
    assert ran_stages(build(recipe, out, stages=FAKE_STAGES, progress=False)) == {"lower": RANKS}

    with open(code_copy["graphs"] / "onnx_export.py", "a") as f:  # the graph exporter (text and tower graphs)
        f.write("\n# edited\n")
    assert ran_stages(build(recipe, out, stages=FAKE_STAGES, progress=False)) == {
        "graph": RANKS, "lower": RANKS, "vision": 1}

    with open(code_copy["plugins"] / "moe_mxfp4" / "triton_kernel.py", "a") as f:  # no ORT-backend stage runs it
        f.write("\n# edited\n")
    assert build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date

    real_versions = keys_mod.library_versions
    monkeypatch.setattr(keys_mod, "library_versions",
                        lambda names: {**real_versions(names), **({"onnxruntime": "0.0.1"} if "onnxruntime" in names else {})})
    assert ran_stages(build(recipe, out, stages=FAKE_STAGES, progress=False)) == {"lower": RANKS}
    assert build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date


def test_every_code_glob_of_a_stage_names_files():
    """A source file that moves keeps shaping its stage's key: every (subpackage, glob) of STAGE_CODE matches a
    file, so a glob left behind by a move fails here instead of silently dropping code from the key."""
    roots = keys_mod.code_roots()
    empty = [(stage, sub, pattern) for stage, globs in keys_mod.STAGE_CODE.items() for sub, pattern in globs
             if not any(p.is_file() for p in roots[sub].glob(pattern))]
    assert empty == []
    assert any(p.name == "graph_form.py" for sub, pattern in keys_mod.STAGE_CODE["graph"]
               for p in roots[sub].glob(pattern))  # a backend's own pool lowering shapes its graphs

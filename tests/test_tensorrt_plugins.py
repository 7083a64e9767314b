"""TensorRT plugin modules under TensorRT's real `tensorrt.plugin` code, for each pinned TensorRT version.

Builds five tiny rank graphs the way `moe-export build` does (tiny-k3: dense MLA; tiny-k3-dsa: DSA indexer +
sparse MLA; both with KDA and MXFP4 experts, as the CPU backend exports them with bf16 cache pools and as a
TensorRT build exports them, computing in bf16, with fp8 (uint8) cache pools; and tiny-k3 for TensorRT in the
wide-EP `dp` layout at world 8, with the MoEDispatch / MoECombine plugins), then runs
`tensorrt_plugin_checks.py` over the TensorRT graphs in a fresh process per version (the QDP registry is process-global) over TensorRT 10.9's and 11.4's pure-Python plugin package,
extracted from the bindings wheels the README's test command downloads into `.whl/`. A missing wheel fails
here (never a skip). What is real and what is a stand-in: `tensorrt_standin.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from moe_export.common.recipe import load_recipe
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.rank import convert_rank
from moe_export.export.convert.synth import write_synthetic_checkpoint
from moe_export.export.backends import backend_for
from moe_export.graphs.onnx_export import export_rank_graph
from moe_export.graphs.sharding import Mapping
from tensorrt_standin import PINNED_WHEELS, WHEEL_DIR, plugin_package_dir

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny_graphs(tmp_path_factory) -> list[Path]:
    cpu, _ = load_recipe("tiny-cpu.yaml")
    fp8_cache = cpu.quantization.model_copy(update={"kv_cache": "fp8"})
    gpu = cpu.model_copy(update={"backend": "tensorrt", "quantization": fp8_cache})
    paths = []
    wide = Mapping(8, 3, 2, 8, "dp")  # wide EP: tp 2 x dp 4 attention groups, experts over all 8 ranks
    for preset, recipe, mapping in (("tiny-k3", cpu, Mapping(4, 1, 2, 2)), ("tiny-k3-dsa", cpu, Mapping(4, 1, 2, 2)),
                                    ("tiny-k3-dsa", gpu, Mapping(4, 1, 2, 2)), ("tiny-k3", gpu, Mapping(4, 1, 2, 2)),
                                    ("tiny-k3", gpu, wide)):  # fmt: skip
        root = tmp_path_factory.mktemp(f"{preset}-{recipe.backend}-{mapping.attention}")
        reader = open_checkpoint(write_synthetic_checkpoint(preset, root / "ckpt", 0))
        convert_rank(reader, reader.config, recipe, mapping, root / "weights.safetensors")
        export_rank_graph(reader.config, recipe, mapping, root / "weights.safetensors", root / "model.onnx",
                          backend_for(recipe).graph_form)
        paths.append(root / "model.onnx")
    return paths


@pytest.mark.parametrize("version", sorted(PINNED_WHEELS))
def test_plugins_under_real_tensorrt_plugin_package(version, tiny_graphs):
    plugin_package_dir(version)  # FileNotFoundError naming the README command when the wheel is missing
    env = dict(os.environ, MOE_EXPORT_TRT_VERSION=version,
               MOE_EXPORT_TRT_GRAPHS=os.pathsep.join(str(p) for p in tiny_graphs))  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / "tensorrt_plugin_checks.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout and "xfail" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("version", sorted(PINNED_WHEELS))
def test_pool_plugin_impls_in_the_interpreter(version):
    """The five pool plugins' JIT impl bodies, called as QDP calls them, reach their pools only
    through the pool table and match the references (`tensorrt_impl_checks.py`, Triton's interpreter)."""
    plugin_package_dir(version)
    env = dict(os.environ, MOE_EXPORT_TRT_VERSION=version, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / "tensorrt_impl_checks.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def test_plugin_package_extraction_when_callers_race(tmp_path):
    """Eight callers extracting the same pinned wheel at once (as the MPI tests' ranks do on a fresh checkout) all
    get the complete package, byte for byte the wheel's, and no temporary folder is left behind."""
    stem = PINNED_WHEELS["11.4"]
    wheels = sorted(WHEEL_DIR.glob(f"{stem}-*.whl"))
    assert wheels, f"no {stem} wheel in {WHEEL_DIR}: run the README's test command"
    (tmp_path / wheels[0].name).symlink_to(wheels[0])
    with zipfile.ZipFile(wheels[0]) as zf:
        want = {Path(n).name: zf.read(n) for n in zf.namelist()
                if n.startswith("tensorrt_bindings/plugin/") and n.endswith(".py")}  # fmt: skip
    start = threading.Barrier(8)

    def extract(_):
        start.wait()
        return plugin_package_dir("11.4", tmp_path)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(extract, range(8)))
    assert set(got) == {tmp_path / stem / "plugin"}
    assert {f.name: f.read_bytes() for f in got[0].iterdir()} == want
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([wheels[0].name, stem])

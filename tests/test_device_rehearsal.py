"""The device commands before a GPU is lent (benchmarks/README.md "Device commands"): each runs here with only the
lent H200's Python packages and the wheels it carries importable (`benchmarks/device_rehearsal.py`) and CUDA
absent (torch's CPU build), and must fail at its first CUDA call, never at an import; the wheels it names cover
what they require; each command fits the 8 minutes a device command may run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import device_rehearsal  # noqa: E402

# device command -> the JSON files it writes under $OUT
COMMANDS = {
    "gpu_check.sh": ["gpu_aot_check.json", "gpu_kernels_check.json", "gpu_sampler_check.json", "gpu_trt_check.json",
                     "gpu_dp_step_check.json", "gpu_check.json"],
    "gpu_torch_check.sh tiny-k3": ["gpu_torch_tiny_k3.json"],
    "gpu_torch_check.sh mid-k3": ["gpu_torch_mid_k3.json"],
}
COMMAND_SECONDS = 8 * 60
SETUP_SECONDS = 30  # device_env.sh (symlinks, pip install of ~15 MB of wheels) and the merge, generously
# What torch's CPU build, torch.distributed without NCCL and the driver stand-in say at a first CUDA call
CUDA_ABSENT = re.compile(r"Torch not compiled with CUDA enabled|Cannot get CUDA generator|no CUDA device here"
                         r"|doesn't have NCCL built in|no CUDA driver here"
                         r"|has no attribute '_cuda_\w+'")  # a CPU build of torch lacks torch._C's CUDA calls
IMPORT_FAILURE = re.compile(r"ModuleNotFoundError|ImportError|No module named")
# Markers as the H200's Python evaluates them (3.12.3, x86-64 Linux)
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def test_device_package_list_is_the_reference_list():
    """benchmarks/device_packages.txt is the list of ../shared/reference/gpu-h200.md (where a checkout has it)."""
    ref = next((p for p in (REPO.parent / "shared", REPO.parents[1] / "shared")
                if (p / "reference" / "gpu-h200.md").is_file()), None)
    if ref is None:
        pytest.skip("no shared/reference/gpu-h200.md beside this checkout")
    text = (ref / "reference" / "gpu-h200.md").read_text()
    listed = text[text.index("The complete list of Python packages"):text.index("(No pydantic")]
    names = {device_rehearsal.normalized(n.strip().rstrip(".")) for n in listed.split("):", 1)[1].split(",")}
    assert names == set(device_rehearsal.listed_names(device_rehearsal.DEVICE_PACKAGES))


def test_carried_wheels_are_the_tested_versions_and_cover_what_they_require():
    """Every wheel of device_wheels.txt pins a version of the major version installed here (what the tests ran), is not on the H200
    already, and what it requires on the H200's Python is on the H200 or carried too (they install --no-deps)."""
    on_device = set(device_rehearsal.listed_names(device_rehearsal.DEVICE_PACKAGES))
    carried = device_rehearsal.listed_names(device_rehearsal.DEVICE_WHEELS)
    assert len(carried) == len(set(carried)) and not set(carried) & on_device
    pins = dict(line.split("#")[0].strip().split("==") for line in device_rehearsal.DEVICE_WHEELS.read_text().splitlines()
                if line.split("#")[0].strip())
    missing = []
    for name, version in pins.items():
        # the rehearsal imports the venv's copy: the same major version as the carried wheel (a fresh install may
        # resolve a newer minor or patch release than the pin; an exact match would fail CI on every release)
        assert Version(importlib.metadata.version(name)).major == Version(version).major, name
        for spec in importlib.metadata.requires(name) or []:
            req = Requirement(spec)
            needed = device_rehearsal.normalized(req.name)
            if (req.marker is None or req.marker.evaluate(DEVICE_MARKERS)) and needed not in on_device | set(carried):
                missing.append(f"{name} requires {req}")
    assert not missing, missing


def run_rehearsed(code: str) -> subprocess.CompletedProcess:
    with_finder = "import device_rehearsal; device_rehearsal.install()\n" + code
    return subprocess.run([sys.executable, "-c", with_finder], cwd=REPO / "benchmarks", capture_output=True, text=True)


def test_rehearsal_hides_what_the_device_lacks():
    """Under the finder: a distribution off the H200 that is installed here (pypdf, kernels) is neither importable nor
    listed, so optional imports behave as there; the H200's packages and the carried wheels import; the CUDA driver
    module is there (the real one or the stand-in) and its first call fails."""
    run = run_rehearsed(
        "import importlib.util, importlib.metadata as md\n"
        "assert importlib.util.find_spec('pypdf') is None\n"
        "try:\n    import pypdf\nexcept ModuleNotFoundError:\n    pass\nelse:\n    raise SystemExit('pypdf imported')\n"
        "try:\n    md.version('pypdf')\nexcept md.PackageNotFoundError:\n    pass\nelse:\n    raise SystemExit('listed')\n"
        "import yaml, numpy, pydantic, torch\n"
        "from cuda.bindings import driver\n"
        "try:\n    driver.cuInit(0)\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cuInit" in run.stdout or "CUDA" in run.stdout or run.stdout == ""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_device_command_fails_at_its_first_cuda_call_not_at_an_import(command, tmp_path):
    """The command under the rehearsal (no carried wheels here: the venv's copies of the named ones serve) writes
    every JSON it names, and every stage's error in them is CUDA's absence, none an import."""
    no_wheels = tmp_path / "wheels"
    no_wheels.mkdir()
    env = device_rehearsal.rehearsal_env(tmp_path / "site")
    env.update(OUT=str(tmp_path / "out"), DEVICE_WHEELS=str(no_wheels), OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", *f"benchmarks/{command}".split()], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = {}
    for name in COMMANDS[command]:
        path = tmp_path / "out" / name
        assert path.is_file(), f"{name} not written: {run.stdout[-2000:]} {run.stderr[-2000:]}"
        errors.update({f"{name}:{k}": v for k, v in json.loads(path.read_text()).items() if k.endswith("_error")})
    assert errors, "no stage failed without a GPU: the rehearsal proves nothing"
    imports = {k: v for k, v in errors.items() if IMPORT_FAILURE.search(v)}
    assert not imports, imports
    assert {k: v for k, v in errors.items() if not CUDA_ABSENT.search(v)} == {}


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_torch_check.sh"])
def test_device_commands_fit_their_minutes(script):
    """Each device command's time limits sum to at most 8 minutes less the set-up (gpu_torch_check.sh: each of its
    two commands), and every Python step it names compiles."""
    import py_compile

    path = REPO / "benchmarks" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    branches = re.split(r"\n  \S+\) ", text) if "case " in text else [text]
    for branch in branches:
        limits = [int(m) for m in re.findall(r"^\s*(?:\S+\) )?timeout (\d+) python3", branch, re.M)]
        assert sum(limits) + SETUP_SECONDS <= COMMAND_SECONDS, (script, limits)
    for step in set(re.findall(r"python3 (benchmarks/\S+\.py)", text)):
        py_compile.compile(str(REPO / step), doraise=True)


def test_tiny_k3_command_stages_run_on_cpu(tmp_path):
    """Command 2's stages for real on the CPU (`gpu_torch_check.py --device cpu`): build, load, greedy generate,
    the fp32 reference and its comparison, and `moe-export serve` answering the openai client."""
    out = tmp_path / "tiny.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_torch_check.py"), "--device", "cpu", "--serve",
                          "--work", str(tmp_path / "work"), "--json", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert not {k: v for k, v in fig.items() if k.endswith("_error")}, fig
    assert len(fig["tiny_k3_engine_tokens"]) == len(fig["tiny_k3_reference_tokens"]) == 16
    divergence = fig["tiny_k3_first_divergence"]
    assert divergence is None or fig["tiny_k3_engine_tokens"][:divergence] == fig["tiny_k3_reference_tokens"][:divergence]
    assert fig["serve"] == "ok" and fig["serve_completion_tokens"] == 8

"""Rehearse a device command here (no GPU) with only the lent H200's Python packages importable.

    python benchmarks/device_rehearsal.py bash benchmarks/gpu_check.sh

runs the command with a `sitecustomize` first on PYTHONPATH, so that every Python process it starts puts
`DeviceOnlyFinder` first on its meta path: a top-level module of an installed distribution that is neither on the
H200 (`device_packages.txt`) nor carried to it as a wheel (`device_wheels.txt`) is refused with
ModuleNotFoundError, as it would be there. The standard library, our package (`moe_export`, from the source
folders) and modules of no distribution (the benchmarks' own) pass. CUDA stays absent (torch's CPU build); where a
package of the H200's list that wraps the CUDA driver is not installed here (cuda-bindings), a stand-in whose every
driver call raises `CudaAbsent` takes its place (its types are empty classes, for isinstance checks in libraries). A command that imports cleanly thus fails at its first CUDA call;
`tests/test_device_rehearsal.py` checks that it does, for every device command.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICE_PACKAGES = HERE / "device_packages.txt"
DEVICE_WHEELS = HERE / "device_wheels.txt"
ENV_FLAG = "MOE_EXPORT_DEVICE_REHEARSAL"
OUR_PACKAGE = "moe_export"
CUDA_DRIVER_MODULES = ("cuda", "cuda.bindings", "cuda.bindings.driver")  # cuda-bindings, on the H200's list


class CudaAbsent(RuntimeError):
    """A CUDA driver call in a rehearsal (no GPU here)."""


def normalized(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_names(path: Path) -> list[str]:
    """The distribution names of a list file: one a line (`name` or `name==version`), `#` comments."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(normalized(re.split(r"[=<>!~ \[;]", line, maxsplit=1)[0]))
    return names


def device_distributions() -> set[str]:
    """Distributions importable on the device: the H200's and the carried wheels'."""
    return set(listed_names(DEVICE_PACKAGES)) | set(listed_names(DEVICE_WHEELS))


class _DriverStandIn(importlib.abc.Loader):
    """`cuda`, `cuda.bindings` and `cuda.bindings.driver` where cuda-bindings is not installed here: the driver
    module's functions (cuInit, ...) raise CudaAbsent, its types (CUstream, ...) are empty classes."""

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        if spec.name == "cuda.bindings.driver":
            types_made: dict[str, type] = {}

            def absent(attr: str):
                if attr.startswith("_"):  # module attributes (__file__, ...) are not driver calls
                    raise AttributeError(attr)
                if attr[0].isupper():  # the driver's types (CUstream, CUresult, ...): classes nothing is an instance of
                    return types_made.setdefault(attr, type(attr, (), {}))

                def call(*_args, **_kwargs):
                    raise CudaAbsent(f"cuda.bindings.driver.{attr}: no CUDA driver here (device rehearsal)")
                return call
            module.__getattr__ = absent
        else:
            module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


class DeviceOnlyFinder(importlib.abc.MetaPathFinder):
    """Refuses top-level modules of distributions the device machine does not have (see the module docstring)."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.owners = importlib.metadata.packages_distributions()  # top-level module -> distributions
        self.driver_installed = "cuda-bindings" in {normalized(d) for names in self.owners.values() for d in names}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in CUDA_DRIVER_MODULES:
            return self._driver_spec(fullname)
        if "." in fullname:
            return None
        top = fullname
        if top in sys.stdlib_module_names or top == OUR_PACKAGE or top.startswith("__editable__"):
            return None
        owners = {normalized(d) for d in self.owners.get(top, ())}
        if not owners or owners & self.allowed:
            return None
        raise ModuleNotFoundError(f"No module named {top!r} on the device machine (distribution "
                                  f"{', '.join(sorted(owners))}: neither on the H200 nor a carried wheel)", name=top)

    def _driver_spec(self, fullname: str):
        """The stand-in's spec where cuda-bindings is not installed here, else None (the real one)."""
        if self.driver_installed:
            return None
        return importlib.machinery.ModuleSpec(fullname, _DriverStandIn(), is_package=fullname != "cuda.bindings.driver")


def install() -> None:
    """Put the finder first on this process's meta path (the sitecustomize's one call)."""
    sys.meta_path.insert(0, DeviceOnlyFinder(device_distributions()))


def rehearsal_env(site_dir: Path, env: dict | None = None) -> dict:
    """`env` (default: this process's) with the sitecustomize in `site_dir` first on PYTHONPATH and CUDA hidden."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(
        "import importlib.util, os\n"
        f"if os.environ.get({ENV_FLAG!r}) == '1':\n"
        f"    spec = importlib.util.spec_from_file_location('device_rehearsal', {str(Path(__file__))!r})\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    module.install()\n"
    )
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), env.get("PYTHONPATH", "")) if p)
    env[ENV_FLAG] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))  # python3 = this one
    return env


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="device-rehearsal-") as tmp:
        return subprocess.run(argv, env=rehearsal_env(Path(tmp))).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

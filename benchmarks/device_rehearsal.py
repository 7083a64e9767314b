"""Rehearse a device command here (no GPU) with only the lent H200's Python packages importable.

    python benchmarks/device_rehearsal.py bash benchmarks/gpu_check.sh

runs the command with a `sitecustomize` first on PYTHONPATH, so that every Python process it starts finds modules
through `DeviceOnlyFinder`: a top-level module of an installed distribution that is neither on the H200
(`device_packages.txt`) nor carried to it as a wheel (`device_wheels.txt`) is not found (ModuleNotFoundError), and
its distribution not listed by importlib.metadata, as there. The standard library, our package (`moe_export`, from the source
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
import sysconfig
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICE_PACKAGES = HERE / "device_packages.txt"
DEVICE_WHEELS = HERE / "device_wheels.txt"
ENV_FLAG = "MOE_EXPORT_DEVICE_REHEARSAL"
OUR_PACKAGE, OUR_DISTRIBUTION = "moe_export", "moe-export"
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


class _DriverFinder(importlib.abc.MetaPathFinder):
    """The driver stand-in's modules (where cuda-bindings is not installed here)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in CUDA_DRIVER_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _DriverStandIn(), is_package=fullname != "cuda.bindings.driver")


class DeviceOnlyFinder(importlib.abc.MetaPathFinder):
    """Stands in for the path finder (`importlib.machinery.PathFinder`) with its answers, except that a top-level
    module whose every distribution is off the device machine is not found (an import raises ModuleNotFoundError,
    `importlib.util.find_spec` gives None: optional imports behave as there) and `importlib.metadata` does not list
    those distributions."""

    def __init__(self, allowed: set[str]) -> None:
        owners = importlib.metadata.packages_distributions()  # top-level module -> distributions
        self.refused = {top for top, dists in owners.items()
                        if top not in sys.stdlib_module_names and top != OUR_PACKAGE
                        and not {normalized(d) for d in dists} & allowed}
        installed = {normalized(d) for dists in owners.values() for d in dists}
        self.refused_distributions = installed - allowed
        self.driver_installed = "cuda-bindings" in installed

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.refused:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, path, target)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):  # noqa: B008 (the stdlib finder's own signature)
        installed_here = Path(sysconfig.get_paths()["purelib"]).resolve()
        for dist in importlib.machinery.PathFinder.find_distributions(context):
            name = normalized(dist.metadata["Name"] or "")
            if name == OUR_DISTRIBUTION:  # only the metadata the device command writes, not this venv's install
                where = Path(str(dist.locate_file(""))).resolve()
                if where != installed_here and installed_here not in where.parents:
                    yield dist
            elif name not in self.refused_distributions:
                yield dist

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()


def install() -> None:
    """Put the finder in the path finder's place on this process's meta path (the sitecustomize's one call)."""
    finder = DeviceOnlyFinder(device_distributions())
    at = sys.meta_path.index(importlib.machinery.PathFinder)
    sys.meta_path[at] = finder
    if not finder.driver_installed:
        sys.meta_path.insert(0, _DriverFinder())


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

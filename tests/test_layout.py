"""Package layout: no module in `export/` or `graphs/` imports `runtime/`, except the CLI (the `moe-export`
script that pyproject.toml names), which is the one place the build side reaches the runtime's commands."""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = "moe_export.runtime"


def _package_dirs() -> dict[str, Path]:
    """Package name -> source folder, from pyproject.toml's setuptools package-dir."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items()}


def _cli_module() -> str:
    """The module of the `moe-export` console script (`[project.scripts]`)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["scripts"]["moe-export"].partition(":")[0]


def _is_runtime(name: str) -> bool:
    return name == RUNTIME or name.startswith(RUNTIME + ".")


def runtime_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The `moe_export.runtime...` names that `source`, the text of `module`, imports: `import`, `from ... import`
    (relative ones resolved against the module's package) and `importlib.import_module` / `__import__` of a
    literal name, wherever they appear (module level or inside functions)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if _is_runtime(n)]
    return found


def _modules(package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package __init__) for every .py file under `package`'s folder."""
    folder = _package_dirs()[package]
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        out[".".join((package, *(parts[:-1] if is_package else parts)))] = (path, is_package)
    return out


@pytest.mark.parametrize("package", ["moe_export.export", "moe_export.graphs"])
def test_build_side_does_not_import_the_runtime_except_the_cli(package):
    modules = _modules(package)
    assert len(modules) > 3  # the walk found the package's files
    cli = _cli_module()
    offenders = {
        name: hits
        for name, (path, is_package) in modules.items()
        if name != cli and (hits := runtime_imports(path.read_text(), name, is_package))
    }
    assert offenders == {}


def test_the_cli_is_the_exception_and_the_walk_sees_its_runtime_imports():
    cli = _cli_module()
    assert cli == "moe_export.export.cli"
    path, is_package = _modules("moe_export.export")[cli]
    hits = runtime_imports(path.read_text(), cli, is_package)
    assert any(h.endswith(": moe_export.runtime.entrypoints.server.launch.serve") for h in hits)


@pytest.mark.parametrize(
    "source",
    [
        "import moe_export.runtime.tokenizer",
        "import moe_export.runtime as rt",
        "from moe_export.runtime.formats import k3",
        "from moe_export import runtime",
        "def f():\n    from moe_export.runtime.chat import render\n",
        "from ..runtime.tokenizer import load_tokenizer",
        "from .. import runtime",
        "import importlib\nimportlib.import_module('moe_export.runtime.images')",
    ],
)
def test_every_import_form_is_caught(source):
    assert runtime_imports(source, "moe_export.export.synth")


@pytest.mark.parametrize(
    "source",
    [
        "from moe_export.graphs.tokens import MEDIA_PAD",
        "from .runtime_notes import x",  # moe_export.graphs.runtime_notes: not the runtime package
        "import moe_export.runtimes",
        "from . import tokens",
    ],
)
def test_other_imports_pass(source):
    assert runtime_imports(source, "moe_export.graphs.vision") == []

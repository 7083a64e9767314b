"""The package's floors (pyproject.toml `[tool.importlinter]`, checked by import-linter) and no import cycles.

Floors, lowest first: common < recipes < quantize < plugins < graphs < export < runtime; inside runtime only the entry
points import the build package. A cycle is a strongly connected component of more than one module in the import
graph: grimp's (the graph import-linter checks; it holds the imports inside functions too) plus the modules
`importlib.import_module` calls may import (`dynamic_imports`)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "recipes", "quantize", "plugins", "graphs", "export", "runtime")


def _lint_imports() -> str:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert found, "import-linter is not installed (test extra)"
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one node of a directed graph (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_import_contracts_hold():
    r = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout


def module_file(module: str) -> Path:
    parts = module.split(".")[1:]  # (the package moe_export is the repository root)
    path = ROOT.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def dynamic_imports(module: str, known: set[str]) -> set[str]:
    """The modules of `known` that `module`'s `importlib.import_module` calls may import: a literal name; an
    f-string matched as a pattern (`{__name__}`: the module's own name, any other field: one name part); any other
    argument: every module named by a string constant in the module (e.g. a table of lazy imports)."""
    tree = ast.parse(module_file(module).read_text())
    found: set[str] = set()
    computed = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and getattr(node.func, "attr", getattr(node.func, "id", None))
                == "import_module"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(arg.value)
        elif isinstance(arg, ast.JoinedStr):
            pattern = "".join(
                re.escape(part.value) if isinstance(part, ast.Constant)
                else re.escape(module) if isinstance(part.value, ast.Name) and part.value.id == "__name__"
                else r"[A-Za-z0-9_]+" for part in arg.values)
            found |= {m for m in known if re.fullmatch(pattern, m)}
        else:
            computed = True
    if computed:
        found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value in known}
    return (found & known) - {module}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports: at its top, inside functions, or through importlib."""
    g = grimp.build_graph(*(f"moe_export.{p}" for p in PACKAGES))
    graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    known = set(graph)
    for m in graph:
        graph[m] |= dynamic_imports(m, known)
    return graph


def test_dynamic_imports_are_edges():
    """The importlib imports the graph must see (a lazy table, a computed name, an f-string pattern)."""
    graph = import_graph()
    assert "moe_export.runtime.client.llm" in graph["moe_export.runtime"]  # runtime.__init__'s lazy LLM
    assert "moe_export.runtime.engine.ort" in graph["moe_export.runtime.engine"]  # the runners table
    assert "moe_export.export.backends.tensorrt" in graph["moe_export.export.backends"]  # f"{__name__}.{name}"
    assert "moe_export.plugins.moe_mxfp4.reference" in graph["moe_export.plugins.registry"]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the package
    assert strongly_connected(graph) == []


def test_a_cycle_through_a_function_level_import_is_found():
    """The graph holds imports inside functions (the TensorRT backend's stage imports its engine builder when it
    runs), and one such import back from a backend into the build's stages (the loop `build.stages` <->
    `backends.tensorrt` had) is a cycle the test above fails on."""
    graph = import_graph()
    assert "moe_export.export.backends.tensorrt.engine" in graph["moe_export.export.backends.tensorrt"]
    graph["moe_export.export.backends.tensorrt"].add("moe_export.export.build.stages")
    cycles = strongly_connected(graph)
    assert len(cycles) == 1
    assert {"moe_export.export.backends.tensorrt", "moe_export.export.build.stages"} <= set(cycles[0])


def test_cycle_finder_finds_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set(), "c": {"c"}}) == []


def test_an_upward_import_breaks_the_floors(tmp_path):
    """import-linter as configured here refuses a foundation module that imports a higher floor."""
    pkg = tmp_path / "floorpkg"
    for sub, body in {"common": "from floorpkg.runtime import engine\n", "runtime": "", "graphs": ""}.items():
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / "mod.py").write_text(body)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "engine.py").write_text("")
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = floorpkg
        [importlinter:contract:floors]
        name = floors
        type = layers
        layers =
            floorpkg.runtime
            floorpkg.graphs
            floorpkg.common
        """))
    r = subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "floorpkg.common.mod -> floorpkg.runtime.engine" in r.stdout


def test_ruff_pyflakes_rules_pass():
    """ruff's pyflakes rules (undefined names, unused imports) over the whole tree (pyproject.toml `[tool.ruff]`)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff is not installed (test extra)"
    r = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def oversized(root: Path) -> list[str]:
    """Modules of the package over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES."""
    import ast

    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(root)
            if text.count("\n") > MAX_MODULE_LINES:
                found.append(f"{where}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_over_600_lines_and_no_function_over_80(tmp_path):
    assert oversized(ROOT) == []
    (tmp_path / "common").mkdir()
    body = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    (tmp_path / "common" / "big.py").write_text(body + "\n" * MAX_MODULE_LINES)
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert [line.split(":")[0] for line in oversized(tmp_path)] == ["common/big.py", "common/big.py"]

"""The engine directory's `manifest.json` and the `verify` view of an engine directory.

The manifest lists every artifact (path relative to the engine directory, size, sha256), the versions
of the tool and its dependencies, the recipe hash, the source checkpoint's file hashes (or its
synthetic preset and seed), the quantization error summary and the content keys of every build stage.
It holds no wall-clock data: two builds of the same inputs write the same bytes.

Build bookkeeping lives in `.state/`, `.cache/` and `.build/` inside the engine directory; those are
not artifacts and `verify` ignores them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

from moe_export.common.atomic import atomic_write_json, sha256_file
from moe_export.common.engine_config import is_engine_config
from moe_export.common.errors import InputError

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPH = "model.onnx"
INTERNAL_DIRS = (".state", ".cache", ".build")
MANIFEST_FORMAT = "moe-export-manifest/1"
DEPENDENCIES = ("torch", "onnx", "onnxruntime", "numpy", "safetensors")


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each distribution in `names` ("not installed" when absent)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def tool_version() -> str:
    return importlib.metadata.version("moe-export")


def dependency_versions() -> dict[str, str]:
    """Versions of moe_export, the libraries that shape the artifacts, and Python."""
    return {"moe_export": tool_version(), "python": platform.python_version(), **library_versions(DEPENDENCIES)}


def quantization_summary(reports: dict[int, dict]) -> dict[str, Any]:
    """Worst-case figures over all ranks from each rank's convert report, plus the per-rank summaries."""
    worst_name, worst_sqnr, max_err, count = None, None, None, 0
    for rank in sorted(reports):
        for entry in reports[rank].get("tensors", []):
            count += 1
            sqnr, err = entry.get("sqnr_db"), entry.get("max_abs_err")
            if isinstance(sqnr, (int, float)) and (worst_sqnr is None or sqnr < worst_sqnr):
                worst_name, worst_sqnr = f"rank{rank}/{entry.get('name')}", sqnr
            if isinstance(err, (int, float)) and (max_err is None or err > max_err):
                max_err = err
    return {
        "quantized_tensors": count,
        "min_sqnr_db": worst_sqnr,
        "min_sqnr_tensor": worst_name,
        "max_abs_err": max_err,
        "per_rank": {f"rank{r}": reports[r].get("summary", {}) for r in sorted(reports)},
    }


def write_manifest(out: Path, manifest: dict) -> None:
    atomic_write_json(Path(out) / MANIFEST, manifest)


def load_manifest(path: str | Path) -> dict:
    """The manifest of an engine directory; InputError if absent or unreadable."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise InputError(f"{path}: no {MANIFEST} (not a finished moe-export build; run `moe-export build` to complete it)")
    try:
        data = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{mpath}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise InputError(f"{mpath}: not a {MANIFEST_FORMAT} manifest")
    return data


def artifact_files(root: Path) -> list[str]:
    """Every file under `root` except the manifest and the build bookkeeping folders, as sorted relative paths."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in INTERNAL_DIRS]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def verify_engine_dir(path: str | Path, deep: bool = True) -> dict[str, Any]:
    """Compare an engine directory with its manifest: missing, altered (size or, with `deep`, sha256)
    and extra files. Returns {"path", "ok", "checked", "missing", "altered", "extra"}."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    manifest = load_manifest(root)
    missing, altered = [], []
    for rel, want in sorted(manifest["files"].items()):
        f = root / rel
        if not f.is_file():
            missing.append(rel)
            continue
        size = f.stat().st_size
        if size != want["size"]:
            altered.append({"file": rel, "reason": f"size {size}, manifest says {want['size']}"})
        elif deep and sha256_file(f) != want["sha256"]:
            altered.append({"file": rel, "reason": "sha256 differs from the manifest"})
    extra = [rel for rel in artifact_files(root) if rel not in manifest["files"]]
    return {
        "path": str(root),
        "ok": not (missing or altered or extra),
        "checked": len(manifest["files"]),
        "missing": missing,
        "altered": altered,
        "extra": extra,
    }


def is_engine_dir(path: str | Path) -> bool:
    """An engine directory has a manifest, or an engine's config.json (`engine_config.is_engine_config`)."""
    root = Path(path)
    return (root / MANIFEST).is_file() or is_engine_config(root)

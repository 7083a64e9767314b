"""The engine directory's `manifest.json`, and the `verify` and `inspect` views of an engine directory.

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
from collections import Counter
from pathlib import Path
from typing import Any

from moe_export.export.atomic import atomic_write_json, sha256_file
from moe_export.export.engine_config import EngineConfig, is_engine_config
from moe_export.export.errors import InputError
from moe_export.export.stage_keys import library_versions

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPH = "model.onnx"
INTERNAL_DIRS = (".state", ".cache", ".build")
MANIFEST_FORMAT = "moe-export-manifest/1"
DEPENDENCIES = ("torch", "onnx", "onnxruntime", "numpy", "safetensors")


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


def _graph_report(path: Path) -> dict[str, Any]:
    """Op counts of an ONNX graph (subgraphs included), read without its external weights."""
    import onnx

    from moe_export.plugins import DOMAIN

    model = onnx.load(str(path), load_external_data=False)
    counts: Counter[str] = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            counts[f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    locations = sorted(
        {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    )
    return {
        "file": path.name,
        "nodes": sum(counts.values()),
        "op_counts": dict(sorted(counts.items())),
        "plugin_nodes": {k: v for k, v in sorted(counts.items()) if k.startswith(f"{DOMAIN}::")},
        "initializers": len(model.graph.initializer),
        "external_data": locations,
    }


def _weights_report(path: Path, classes: dict[str, str]) -> dict[str, Any]:
    """Tensors and bytes by weight class from a safetensors header (tensor data is not read)."""
    from moe_export.export.checkpoint import read_safetensors_header
    from moe_export.graphs.weights import classify_tensor_name

    tensors, problems = read_safetensors_header(path)
    by_class: dict[str, dict[str, int]] = {}
    for t in tensors:
        cls = classes.get(t.name) or classify_tensor_name(t.name)
        row = by_class.setdefault(cls, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.nbytes
    return {
        "file": path.name,
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "classes": dict(sorted(by_class.items())),
        "problems": [str(p) for p in problems],
    }


def _rank_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("rank") and d.name[4:].isdigit():
            out.append((int(d.name[4:]), d))
    return sorted(out)


def inspect_engine(path: str | Path) -> dict[str, Any]:
    """Ranks, mapping, per-rank graphs (op counts, plugin nodes), weights by class, backend files and
    manifest status (sizes only; `verify` re-hashes)."""
    root = Path(path)
    cfg = EngineConfig.read(root)
    per_rank_mapping = {m["rank"]: m for m in cfg.ranks if "rank" in m}
    ranks = []
    for n, d in _rank_dirs(root):
        entry: dict[str, Any] = {"rank": n, "mapping": per_rank_mapping.get(n)}
        entry["graph"] = _graph_report(d / GRAPH) if (d / GRAPH).is_file() else None
        entry["weights"] = _weights_report(d / WEIGHTS, cfg.weight_classes) if (d / WEIGHTS).is_file() else None
        entry["ort_segments"] = sorted(p.name for p in d.glob("ort_segment_*.onnx"))
        entry["engine"] = sorted(p.name for p in d.glob("*.engine"))
        ranks.append(entry)
    if (root / MANIFEST).is_file():
        try:
            status = verify_engine_dir(root, deep=False)
            manifest = {"present": True, "ok": status["ok"], "checked": status["checked"],
                        "missing": status["missing"], "altered": status["altered"], "extra": status["extra"],
                        "hashes_checked": False}
        except InputError as exc:
            manifest = {"present": True, "ok": False, "error": str(exc)}
    else:
        manifest = {"present": False, "ok": False}
    return {
        "kind": "engine",
        "path": str(root),
        "format": cfg.to_dict()["format"],
        "architecture": cfg.architecture,
        "model_type": cfg.model_type,
        "backend": cfg.backend,
        "mapping": cfg.mapping.to_dict(),
        "num_ranks": len(ranks),
        "ranks": ranks,
        "manifest": manifest,
    }


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render_engine_report(report: dict[str, Any], console) -> None:
    """Print `inspect_engine`'s report with rich: mapping, weights by class per rank, graph ops, manifest."""
    from rich.table import Table

    m = report.get("mapping") or {}
    console.print(
        f"[bold]{report['path']}[/]: engine for {report.get('architecture')}, backend {report.get('backend')}, "
        f"{report['num_ranks']} rank(s) (world {m.get('world_size')}, tp {m.get('tp_size')}, ep {m.get('ep_size')})",
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"chat format: {report.get('chat_format')}", highlight=False, soft_wrap=True)
    table = Table(title="weights by class, per rank")
    table.add_column("weight class")
    table.add_column("tensors", justify="right")
    table.add_column("bytes (min - max over ranks)", justify="right")
    table.add_column("all ranks", justify="right")
    weights = [r["weights"] for r in report["ranks"] if r["weights"]]
    for cls in sorted({c for w in weights for c in w["classes"]}):
        rows = [w["classes"].get(cls, {"tensors": 0, "bytes": 0}) for w in weights]
        t_lo, t_hi = min(x["tensors"] for x in rows), max(x["tensors"] for x in rows)
        b_lo, b_hi = min(x["bytes"] for x in rows), max(x["bytes"] for x in rows)
        table.add_row(
            cls,
            str(t_lo) if t_lo == t_hi else f"{t_lo} - {t_hi}",
            _human_bytes(b_lo) if b_lo == b_hi else f"{_human_bytes(b_lo)} - {_human_bytes(b_hi)}",
            _human_bytes(sum(x["bytes"] for x in rows)),
        )
    totals = [w["bytes"] for w in weights]
    if totals:
        table.add_row("total", "", f"{_human_bytes(min(totals))} - {_human_bytes(max(totals))}",
                      _human_bytes(sum(totals)), style="bold")
    console.print(table)
    missing = [str(r["rank"]) for r in report["ranks"] if not r["weights"]]
    if missing:
        console.print(f"[red]no weights file for rank(s) {', '.join(missing)}[/]", highlight=False)
    for r in report["ranks"]:
        g = r["graph"]
        if g is None:
            console.print(f"rank {r['rank']}: no graph", highlight=False)
            continue
        plugins = ", ".join(f"{k.split('::', 1)[1]} x{v}" for k, v in g["plugin_nodes"].items()) or "none"
        backend = (f"{len(r['ort_segments'])} ORT segment(s)" if r["ort_segments"] else "") or ", ".join(r["engine"])
        console.print(
            f"rank {r['rank']}: {g['nodes']} nodes, {len(g['op_counts'])} op types; plugins: {plugins}; {backend}",
            highlight=False,
            soft_wrap=True,
        )
    man = report["manifest"]
    if not man["present"]:
        console.print("[yellow]no manifest.json: the build is unfinished[/]")
    elif man.get("error"):
        console.print(f"[red]manifest unusable: {man['error']}[/]", highlight=False)
    elif man["ok"]:
        console.print(f"[green]manifest: {man['checked']} file(s) present with the listed sizes[/] (`verify` re-hashes)")
    else:
        console.print(
            f"[red]manifest: {len(man['missing'])} missing, {len(man['altered'])} altered, {len(man['extra'])} extra[/]",
            highlight=False,
        )

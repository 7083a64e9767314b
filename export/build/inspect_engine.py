"""`moe-export inspect` on an engine directory: ranks, mapping, per-rank graphs (op counts, plugin nodes),
weights by class, backend files and manifest status (sizes only; `verify` re-hashes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.common.manifest import (
    GRAPH,
    MANIFEST,
    WEIGHTS,
    verify_engine_dir,
)


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
    from moe_export.export.convert.checkpoint import read_safetensors_header
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
        "mapping": cfg.mapping.layout_dict(),
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
        if g is None and report.get("backend") == "torch":  # the PyTorch runner runs the weights as they are
            console.print(f"rank {r['rank']}: no graph by design (backend torch: the PyTorch runner runs the "
                          "converted weights)", highlight=False, soft_wrap=True)  # fmt: skip
            continue
        if g is None:
            console.print(f"[red]rank {r['rank']}: no graph ({GRAPH} missing)[/]", highlight=False)
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

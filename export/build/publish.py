"""The end of a build: the global artifacts (config.json, LICENSE, tokenizer), publishing the staged outputs into
the engine directory, and the manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moe_export.common.atomic import atomic_path, fsync_path
from moe_export.common.engine_config import CONFIG, EngineConfig
from moe_export.common.manifest import (
    GRAPH,
    MANIFEST,
    MANIFEST_FORMAT,
    WEIGHTS,
    dependency_versions,
    quantization_summary,
    tool_version,
)
from moe_export.export.backends import backend_for
from moe_export.export.build.records import QUANT_REPORT
from moe_export.export.build.source import LICENSE
from moe_export.export.build.stages import BuildContext


def weight_class_map(ctx: BuildContext) -> dict[str, str]:
    """Weight class of every tensor name in the ranks' weights files (headers only)."""
    from moe_export.export.convert.checkpoint import read_safetensors_header
    from moe_export.graphs.weights import all_tensor_specs, classify_tensor_name

    cfg = ctx.reader.config
    spec_class = {s.name: s.weight_class for s in all_tensor_specs(cfg, include_experts=False)}
    out: dict[str, str] = {}
    for n in range(ctx.recipe.target.world_size):
        tensors, _ = read_safetensors_header(ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}"))
        for t in tensors:
            if t.name not in out:
                out[t.name] = spec_class.get(t.name) or (
                    "routed_experts" if ".experts." in t.name else classify_tensor_name(t.name)
                )
    return dict(sorted(out.items()))


def engine_config(ctx: BuildContext) -> EngineConfig:
    """The engine's config.json."""
    backend = backend_for(ctx.recipe)
    files = {"rank_dir": "rank{rank}", "weights": WEIGHTS, "quantization_report": QUANT_REPORT,
             **({"graph": GRAPH} if backend.graph_form is not None else {}), **backend.config_files}
    from moe_export.export.plan.planner import engine_memory

    return EngineConfig.from_recipe(ctx.recipe, ctx.reader.config, version=tool_version(), files=files,
                                    weight_classes=weight_class_map(ctx),
                                    memory=engine_memory(ctx.recipe, ctx.reader.config))


def build_globals(ctx: BuildContext) -> list[str]:
    ran = []
    src = ctx.source
    if not ctx.state.current("config", ctx.keys["config"]):
        engine_config(ctx).write(ctx.state.build)
        ctx.state.record("config", ctx.keys["config"], [CONFIG], None)
        ran.append("config")
    if not ctx.state.current("license", ctx.keys["license"]):
        outputs = []
        if src.license_file:
            with atomic_path(ctx.state.build / LICENSE) as tmp:
                shutil.copyfile(src.path / src.license_file, tmp)
            outputs = [LICENSE]
        ctx.state.record("license", ctx.keys["license"], outputs, None)
        ran.append("license")
    if not ctx.state.current("tokenizer", ctx.keys["tokenizer"]):
        for name in src.tokenizer_files:
            with atomic_path(ctx.state.build / name) as tmp:
                shutil.copyfile(src.path / name, tmp)
        ctx.state.record("tokenizer", ctx.keys["tokenizer"], sorted(src.tokenizer_files), None)
        ran.append("tokenizer")
    return ran


def publish(ctx: BuildContext, outputs: dict[str, dict]) -> tuple[list[str], list[str]]:
    """Move the stage outputs staged in .build into OUT and remove artifacts of earlier builds that this
    one no longer has; returns (files moved, stale files removed). The manifest is removed first, so a
    half-published folder never has one."""
    out, build = ctx.out, ctx.state.build
    prev = ctx.state.load("publish") or {}
    prev_files = set(prev.get("files", []))
    to_move = [rel for rel in sorted(outputs) if ctx.state.locate(rel, outputs[rel]) == build / rel]
    stale = sorted(rel for rel in prev_files - set(outputs) if (out / rel).exists())
    if not (to_move or stale) and prev.get("complete") and prev_files == set(outputs):
        return [], []
    if to_move or stale:
        (out / MANIFEST).unlink(missing_ok=True)
    ctx.state.write("publish", {"files": sorted(prev_files | set(outputs)), "complete": False})
    for rel in to_move:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(build / rel, out / rel)
    for folder in sorted({(out / rel).parent for rel in to_move}):
        fsync_path(folder)
    for rel in stale:
        (out / rel).unlink(missing_ok=True)
        parent = (out / rel).parent
        if parent != out and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    ctx.state.write("publish", {"files": sorted(outputs), "complete": True})
    return to_move, stale


def empty_build_folder(build: Path) -> None:
    """After publish every current output is in OUT: what is left in .build was superseded (outputs of
    a stage that ran again before the build finished, segments of an abandoned lowering)."""
    for path in build.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def build_manifest(ctx: BuildContext, records: dict[str, dict]) -> dict:
    """The manifest of the current build (deterministic: no times, no local paths of the output)."""
    files = {}
    for rec in records.values():
        for rel, meta in rec["outputs"].items():
            files[rel] = {"size": meta["size"], "sha256": meta["sha256"]}
    reports = {}
    for n in range(ctx.recipe.target.world_size):
        reports[n] = json.loads(ctx.state.output(f"convert/rank{n}", f"rank{n}/{QUANT_REPORT}").read_text())
    src = ctx.source
    lic = (
        {"file": LICENSE, "source_file": src.license_file, "sha256": src.license_sha256}
        if src.license_file
        else {"file": None, "note": "the source checkpoint has no LICENSE file; check the model's terms before "
              "distributing these artifacts"}
    )
    return {
        "format": MANIFEST_FORMAT,
        "tool": "moe-export",
        "versions": dependency_versions(),
        "recipe": {"name": ctx.recipe.name, "sha256": ctx.recipe.fingerprint()},
        "backend": ctx.recipe.backend,
        "source": src.manifest_entry(),
        "license": lic,
        "quantization": quantization_summary(reports),
        "stages": {name: records[name]["key"] for name in sorted(records)},
        "files": dict(sorted(files.items())),
    }

"""The stages a build runs for every backend, the work they do (`Stages`) and the build's context.

Each rank stage function `run_<stage>(ctx, n, mapping)` stages its outputs in `.build/` and returns (outputs
relative to the engine directory, result, what it read of the source or None); a backend adds its own stages
(`export/backends/`), whose work `Stages.work` gives. The work is imported lazily, so a fully up-to-date build
imports none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_export.common.atomic import atomic_path, atomic_write_json
from moe_export.common.errors import BuildError, InputError
from moe_export.common.manifest import GRAPH, WEIGHTS
from moe_export.common.mapping import Mapping
from moe_export.common.recipe import Recipe
from moe_export.export.build import source_reads
from moe_export.export.build.progress import Progress
from moe_export.export.build.records import QUANT_REPORT, StageRecords, move_into, scratch, stage_failed
from moe_export.export.build.source import Source


def _convert_rank(reader, cfg, recipe, mapping, out_path: Path) -> dict:
    from moe_export.export.convert.rank import convert_rank

    return convert_rank(reader, cfg, recipe, mapping, out_path)


def _export_rank_graph(cfg, recipe, mapping, weights_path: Path, out_path: Path) -> dict:
    from moe_export.export.backends import backend_for
    from moe_export.graphs.onnx_export import export_rank_graph

    return export_rank_graph(cfg, recipe, mapping, weights_path, out_path, backend_for(recipe).graph_form)


@dataclass(frozen=True)
class Stages:
    """The work the driver's stages do (the defaults are the real ones; a test passes stand-ins). `convert_rank`
    reads the source only through the reader it is given: its reads are what identify the source bytes it used.
    `backend_work`: a backend stage's name (`BackendStage.name`: "lower", "engine", "vision_engine") -> a stand-in
    for the work that stage does, with the signature of the backend's own function."""

    convert_rank: Callable[..., dict] = _convert_rank
    export_rank_graph: Callable[..., dict] = _export_rank_graph
    backend_work: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def work(self, stage: str, own: Callable[..., Any]) -> Callable[..., Any]:
        """What backend stage `stage` runs: its stand-in if the build was given one, else `own`."""
        return self.backend_work.get(stage, own)


@dataclass
class BuildContext:
    """What the stages of one build process share: the recipe, the output, the stages' work, the records, the opened
    source and the content keys known so far."""

    recipe: Recipe
    out: Path
    stages: Stages
    state: StageRecords
    progress: Progress
    expected_bytes: dict[int, int]
    reader: Any = None
    source: Source | None = None
    code: dict[str, dict] = field(default_factory=dict)  # stage_keys.code_fingerprints()
    keys: dict[str, str] = field(default_factory=dict)  # filled stage by stage: convert keys first


def run_convert(ctx: BuildContext, n: int, mapping: Mapping) -> tuple[list[str], Any, dict]:
    """Convert with every source read hashed as it streams through; returns outputs, result and the
    record of what was read (`source_reads`)."""
    rdir = ctx.state.build / f"rank{n}"
    with atomic_path(rdir / WEIGHTS) as tmp, ctx.progress.task(f"convert rank {n}", tmp, ctx.expected_bytes.get(n)):
        report, source = source_reads.record_reads(
            ctx.reader, lambda: ctx.stages.convert_rank(ctx.reader, ctx.reader.config, ctx.recipe, mapping, tmp))
    atomic_write_json(rdir / QUANT_REPORT, report)
    return [f"rank{n}/{WEIGHTS}", f"rank{n}/{QUANT_REPORT}"], {"summary": report.get("summary")}, source


def run_graph(ctx: BuildContext, n: int, mapping: Mapping) -> tuple[list[str], Any, None]:
    rdir = ctx.state.build / f"rank{n}"
    weights = ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")
    with atomic_path(rdir / GRAPH) as tmp, ctx.progress.task(f"graph rank {n}", tmp):
        summary = ctx.stages.export_rank_graph(ctx.reader.config, ctx.recipe, mapping, weights, tmp)
    return [f"rank{n}/{GRAPH}"], summary, None


def run_vision(ctx: BuildContext) -> list[str]:
    """K3's tower + projector: `vision.safetensors` (the checkpoint's bf16 tensors) and `vision.onnx`, once per
    engine (every rank loads the same replicated tower). Nothing for a model without a tower."""
    from moe_export.graphs.vision import VISION_NORM_EPS, vision_config
    from moe_export.graphs.vision_export import (
        VISION_GRAPH,
        VISION_WEIGHTS,
        export_vision_graph,
        write_vision_weights,
    )

    vc = vision_config(ctx.reader.config)
    if vc is None or ctx.state.current("vision", ctx.keys["vision"]):
        return []
    try:
        with atomic_path(ctx.state.build / VISION_WEIGHTS) as tmp:
            write_vision_weights(ctx.reader, vc, tmp)
        with scratch(ctx.state.build, "vision", {VISION_WEIGHTS: ctx.state.build / VISION_WEIGHTS}) as tmp:
            summary = export_vision_graph(vc, tmp / VISION_WEIGHTS, tmp / VISION_GRAPH,
                                          VISION_NORM_EPS[ctx.recipe.vision.rms_norm_eps])
            move_into(tmp / VISION_GRAPH, ctx.state.build / VISION_GRAPH)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise stage_failed("vision", exc) from exc
    ctx.state.record("vision", ctx.keys["vision"], [VISION_WEIGHTS, VISION_GRAPH], summary)
    return ["vision"]

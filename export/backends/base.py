"""What a backend is to the build: `Backend` (its graph form, its stages, its config.json files, a check that it
can build here) and `BackendStage` (a build stage it adds); the registry is the package (`backend_named`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_export.common.recipe import Recipe
from moe_export.graphs.onnx_export import GraphForm


@dataclass(frozen=True)
class BackendStage:
    """A build stage a backend adds. `run(ctx, n, mapping)` (per rank) or `run(ctx)` (the tower) returns the
    outputs it staged (paths relative to the engine directory), its result (JSON) and None; it does its work with
    `ctx.stages.work(name, own)` (the backend's own function unless the build was given a stand-in); the stage's content
    key covers `fields` (dotted recipe fields), the upstream stage's key, the sha256 of the source files in `code`
    ((subpackage of moe_export, glob) pairs) and the versions of `libraries`."""

    name: str
    fields: tuple[str, ...]
    code: tuple[tuple[str, str], ...]
    libraries: tuple[str, ...]
    run: Callable[..., Any]


def _no_check(recipe: Recipe, stages: Any) -> None:
    """Nothing to check: the backend builds with what moe-export depends on."""


@dataclass(frozen=True)
class Backend:
    """What the build does for one backend (see the package docstring); what the planner counts for it is
    `plan.backend_terms`."""

    name: str
    graph_form: GraphForm | None
    rank_stage: BackendStage | None
    tower_stage: BackendStage | None = None
    config_files: dict[str, str] = field(default_factory=dict)
    check_available: Callable[[Recipe, Any], None] = _no_check

    @property
    def rank_stage_names(self) -> tuple[str, ...]:
        """A rank's stages in build order."""
        graph = ("graph",) if self.graph_form is not None else ()
        return ("convert", *graph, *((self.rank_stage.name,) if self.rank_stage else ()))

    @property
    def stages(self) -> tuple[BackendStage, ...]:
        return tuple(s for s in (self.rank_stage, self.tower_stage) if s is not None)

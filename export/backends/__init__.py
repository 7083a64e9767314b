"""Backends, build side: what each backend makes of a converted rank, one module per backend.

A backend module (`export/backends/<name>.py`, named like the recipe's `backend`) defines `BACKEND`, a
`Backend`: the graph form it wants (`graphs.onnx_export.GraphForm`, or None when its runner reads the converted
weights without an ONNX graph), the stage that lowers a rank's graph into its artifact (`rank_stage`, after the
`graph` stage), the stage that lowers K3's vision tower graph (`tower_stage`), the file patterns it adds to
config.json, what the planner counts for it, and a check that it can build here. The runner side of a backend is
registered in `moe_export.runtime.engine.RUNNERS`; runners never import this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_export.common.recipe import Recipe
from moe_export.graphs.onnx_export import GraphForm

BACKEND_NAMES = ("onnxruntime", "tensorrt", "torch")  # modules of this package, one per recipe backend


@dataclass(frozen=True)
class BackendStage:
    """A build stage a backend adds. `run(ctx, n, mapping)` (per rank) or `run(ctx)` (the tower) returns the
    outputs it staged (paths relative to the engine directory), its result (JSON) and None; the stage's content
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
    """What the build and the planner do for one backend (see the module docstring).

    weight_bytes: bytes per element of a non-fp32 weight as the built engine holds it (what its graph computes in:
    2 for bf16, 4 for fp32); engine_memory: the planner counts an engine's activation memory and plugin workspaces
    on the GPU (else they stay within the reserve); tower_scores: K3's tower materializes each image's attention
    scores (no flash attention), which the planner counts in its activations; nccl: the collectives run over NCCL,
    whose device buffers the planner counts beside the engine (`plan_memory.nccl_buffer_bytes`)."""

    name: str
    graph_form: GraphForm | None
    rank_stage: BackendStage | None
    tower_stage: BackendStage | None = None
    config_files: dict[str, str] = field(default_factory=dict)
    weight_bytes: Callable[[Recipe], float] = lambda recipe: 4.0
    engine_memory: bool = False
    tower_scores: bool = True
    nccl: bool = False
    check_available: Callable[[Recipe, Any], None] = _no_check

    @property
    def rank_stage_names(self) -> tuple[str, ...]:
        """A rank's stages in build order."""
        graph = ("graph",) if self.graph_form is not None else ()
        return ("convert", *graph, *((self.rank_stage.name,) if self.rank_stage else ()))

    @property
    def stages(self) -> tuple[BackendStage, ...]:
        return tuple(s for s in (self.rank_stage, self.tower_stage) if s is not None)


def backend_named(name: str) -> Backend:
    """The `Backend` of the module `export/backends/<name>.py`."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def backend_for(recipe: Recipe) -> Backend:
    """The backend the recipe builds for (`recipe.backend`)."""
    return backend_named(recipe.backend)


def all_backends() -> tuple[Backend, ...]:
    return tuple(backend_named(name) for name in BACKEND_NAMES)

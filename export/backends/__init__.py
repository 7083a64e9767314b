"""Backends, build side: what each backend makes of a converted rank, one module (or package) per backend.

A backend module (`export/backends/<name>.py` or `<name>/`, named like the recipe's `backend`) defines `BACKEND`, a
`Backend` (`base.py`): the graph form it wants (`graphs.onnx_form.GraphForm`, with its own pool lowering where the
graph reaches the pools its own way, or None when its runner reads the converted weights without an ONNX graph),
the stage that lowers a rank's graph into its artifact (`rank_stage`, after the `graph` stage), the stage that
lowers K3's vision tower graph (`tower_stage`), the file patterns it adds to config.json, and a check that it can
build here. What the planner counts for it is `export/plan/backend_terms.py`. The runner side of a backend is
registered in `moe_export.runtime.engine.RUNNERS`; runners never import this package.
"""

from __future__ import annotations

import importlib

from moe_export.common.recipe import Recipe
from moe_export.export.backends.base import Backend, BackendStage

__all__ = ["BACKEND_NAMES", "Backend", "BackendStage", "all_backends", "backend_for", "backend_named"]
BACKEND_NAMES = ("onnxruntime", "tensorrt", "torch")  # modules of this package, one per recipe backend


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

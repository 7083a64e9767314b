"""The build driver (`driver`: a recipe in, an engine directory out) and what it runs on: the stages every backend
runs and the build's context (`stages`), content keys (`stage_keys`), the source (`source`, `source_reads`),
records and scratch folders (`records`), publishing and the manifest (`publish`), the lock and progress, and
`inspect` of an engine directory (`inspect_engine`).

`build`, `describe`, `BuildResult` and `Stages` are the driver's, imported when first named (the backends stage
with `records`, and the driver imports the backends, so this package itself imports nothing)."""

from __future__ import annotations

import importlib

_LAZY = {"build": "moe_export.export.build.driver", "describe": "moe_export.export.build.driver",
         "BuildResult": "moe_export.export.build.driver", "Stages": "moe_export.export.build.stages",
         "BuildError": "moe_export.common.errors"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

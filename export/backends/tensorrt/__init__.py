"""The TensorRT backend (GPU): one engine per rank (`engine.py`) with its collectives inside as NCCL plugins, and K3's
vision tower as one engine every rank loads (`vision.py`); the graphs compute in bf16 and the plugins update the
state pools in place (`graph_form.py`). The engine file format is `common/engine_file.py`; the runner is
`runtime/engine/tensorrt.py`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

from moe_export.common.engine_file import VISION_ENGINE, rank_engine_name
from moe_export.common.errors import BuildError, InputError
from moe_export.common.manifest import GRAPH, WEIGHTS
from moe_export.common.recipe import Recipe
from moe_export.export.backends.base import Backend, BackendStage
from moe_export.export.backends.tensorrt.graph_form import PoolsInPlace
from moe_export.export.build.records import move_into, scratch
from moe_export.graphs.onnx_export import GraphForm
from onnx import TensorProto


def run_engine(ctx, n: int, mapping) -> tuple[list[str], Any, None]:
    """Stage `engine` of rank n (`ctx`: a `build.stages.BuildContext`): build in a scratch folder that shows the
    graph with its weights next to it (one may be staged, the other published); TensorRT's timing cache is kept in
    .cache/tensorrt between builds."""
    rdir = ctx.state.build / f"rank{n}"
    name = rank_engine_name(n)
    timing = ctx.out / ".cache" / "tensorrt" / f"rank{n}.timing_cache"
    inputs = {GRAPH: ctx.state.output(f"graph/rank{n}", f"rank{n}/{GRAPH}"),
              WEIGHTS: ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")}
    with scratch(rdir, "engine", inputs) as tmp, ctx.progress.task(f"engine rank {n}", tmp):
        if timing.is_file():
            shutil.copyfile(timing, tmp / timing.name)
        from moe_export.export.backends.tensorrt.engine import build_tensorrt_engine

        ctx.stages.work("engine", build_tensorrt_engine)(tmp / GRAPH, ctx.recipe, mapping, tmp / name)
        if not (tmp / name).is_file():
            raise BuildError(f"engine rank {n}: the engine builder wrote no {name}")
        if (tmp / timing.name).is_file():
            timing.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / timing.name, timing)
        move_into(tmp / name, rdir / name)
    return [f"rank{n}/{name}"], None, None


def run_vision_engine(ctx) -> tuple[list[str], Any, None]:
    """Stage `vision_engine`: the tower graph built into `vision.engine`, one file every rank loads, in a scratch
    folder showing the graph next to its weights."""
    from moe_export.export.backends.tensorrt.vision import build_vision_engine
    from moe_export.graphs.vision_export import VISION_GRAPH, VISION_WEIGHTS

    inputs = {name: ctx.state.output("vision", name) for name in (VISION_GRAPH, VISION_WEIGHTS)}
    with scratch(ctx.state.build, "vision_engine", inputs) as tmp, ctx.progress.task("vision engine", tmp):
        ctx.stages.work("vision_engine", build_vision_engine)(tmp / VISION_GRAPH, ctx.recipe, ctx.reader.config,
                                                              tmp / VISION_ENGINE)
        if not (tmp / VISION_ENGINE).is_file():
            raise BuildError(f"vision engine: the engine builder wrote no {VISION_ENGINE}")
        move_into(tmp / VISION_ENGINE, ctx.state.build / VISION_ENGINE)
    return [VISION_ENGINE], None, None


def check_tensorrt(recipe: Recipe, stages) -> None:
    """The real engine builder needs TensorRT (unless the build was given a stand-in for it): say so before hours of
    conversion, not after."""
    if "engine" not in stages.backend_work and importlib.util.find_spec("tensorrt") is None:
        raise InputError(
            f"recipe {recipe.name}: backend 'tensorrt' needs the TensorRT Python package, which is not installed; "
            "build on a GPU machine with TensorRT >= 10.9, or use backend: onnxruntime"
        )


_ENGINE_CODE = (("export", "backends/tensorrt/*.py"), ("export", "plan/planner.py"), ("export", "plan/memory.py"),
                ("export", "plan/backend_terms.py"), ("common", "engine_file.py"))
BACKEND = Backend(
    name="tensorrt",
    graph_form=GraphForm(TensorProto.BFLOAT16, pools=PoolsInPlace(), ordered_collectives=True),
    rank_stage=BackendStage("engine", fields=("limits", "target", "workspace_reserve_gib", "tensorrt"),
                            code=(*_ENGINE_CODE, ("plugins", "**/*.py")), libraries=("onnx", "tensorrt", "numpy"),
                            run=run_engine),
    tower_stage=BackendStage("vision_engine", fields=("limits.max_images_per_request", "limits.max_image_patches",
                                                      "target", "workspace_reserve_gib", "parallel.tp"),
                             code=(*_ENGINE_CODE, ("graphs", "vision.py")), libraries=("onnx", "tensorrt", "numpy"),
                             run=run_vision_engine),
    config_files={"engine": "rank{rank}.engine"},
    check_available=check_tensorrt,
)

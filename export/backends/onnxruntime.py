"""The ONNX Runtime backend (CPU): a rank's exported graph cut at its collectives into segments.

ONNX Runtime cannot run Python kernels in our domain at useful speed and we have no ORT C headers here, so each
plugin ships its ONNX Runtime kernel as a model-local ONNX function in standard ops (`plugins/<op>/ort.py`), which
ORT inlines. Collectives cannot live inside an ORT graph, so the graph is split at every `AllReduce` /
`AllGather` / `MoEDispatch` / `MoECombine` node into segments; the runner (`runtime/engine/ort.py`) runs a segment,
performs the collective with MPI (or in process), and feeds the next segment.

    rank{N}/ort_segment_000.onnx   segments, each referencing rank{N}/weights.safetensors
    rank{N}/ort_plan.json          the steps in order (`common/ort_plan.py`: `OrtPlan`, the runner's contract)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from moe_export.common.errors import BuildError
from moe_export.common.manifest import GRAPH, WEIGHTS
from moe_export.common.ort_plan import CollectiveStep, OrtPlan, PlanStep, SegmentStep
from moe_export.export.backends.base import Backend, BackendStage
from moe_export.export.build.records import QUANT_REPORT, move_into, scratch
from moe_export.graphs.onnx_export import GraphForm
from moe_export.plugins import DOMAIN
from moe_export.plugins.collectives.onnx_schema import COLLECTIVE_OPS
from moe_export.plugins.registry import ort_function, register_all_schemas


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types of every value, from the graph's inputs/outputs and (non-strict) shape inference."""
    register_all_schemas()
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=False)
    types = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        types[vi.name] = vi.type
    return types


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    if name in types:
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(types[name])
        return vi
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def split_at_collectives(model: onnx.ModelProto) -> tuple[list[list[onnx.NodeProto]], list[onnx.NodeProto]]:
    """Node lists between collective nodes (in graph order) and the collective nodes themselves."""
    segments: list[list[onnx.NodeProto]] = [[]]
    collectives = []
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type in COLLECTIVE_OPS:
            collectives.append(node)
            segments.append([])
        else:
            segments[-1].append(node)
    return segments, collectives


@dataclass
class Segment:
    """The nodes between two collectives, with the values they take from outside and hand on."""

    index: int
    nodes: list[onnx.NodeProto]
    inputs: list[str]  # produced earlier (graph inputs, earlier segments, collectives); initializers excluded
    outputs: list[str]  # consumed later (later segments, collectives, graph outputs)
    initializers: list[onnx.TensorProto]


def plan_segments(model: onnx.ModelProto) -> list[Segment | CollectiveStep]:
    """The graph cut at its collectives, in order: `Segment`s (empty ones dropped) and `CollectiveStep`s."""
    segments, collectives = split_at_collectives(model)
    inits = {t.name: t for t in model.graph.initializer}
    graph_outputs = [v.name for v in model.graph.output]

    # Which values each later step consumes: segment inputs, collective inputs, graph outputs.
    consumers_after: list[set[str]] = []
    later: set[str] = set(graph_outputs)
    steps = []
    for k in range(len(segments)):
        steps.append(("segment", segments[k]))
        if k < len(collectives):
            steps.append(("collective", collectives[k]))
    for kind, item in reversed(steps):
        consumers_after.append(set(later))
        if kind == "segment":
            for node in item:
                later.update(i for i in node.input if i)
        else:
            later.update(i for i in item.input if i)
    consumers_after.reverse()

    plan: list[Segment | CollectiveStep] = []
    for (kind, item), needed_later in zip(steps, consumers_after):
        if kind == "collective":
            attrs = {}
            for a in item.attribute:
                if a.name in ("group", "axis", "num_experts"):
                    value = helper.get_attribute_value(a)
                    attrs[a.name] = value.decode() if isinstance(value, bytes) else value
            every = len(item.input) > 1 or len(item.output) > 1  # MoEDispatch / MoECombine: every value in order
            plan.append(CollectiveStep(item.op_type, item.input[0], item.output[0], **attrs,
                                       inputs=tuple(item.input) if every else (),
                                       outputs=tuple(item.output) if every else ()))
            continue
        if not item:
            continue
        produced = {o for n in item for o in n.output}
        used = [i for n in item for i in n.input if i]
        plan.append(Segment(
            index=sum(isinstance(s, Segment) for s in plan),
            nodes=item,
            inputs=sorted({i for i in used if i not in produced and i not in inits}),
            outputs=sorted(o for o in produced if o in needed_later),
            initializers=[inits[i] for i in sorted({i for i in used if i in inits})],
        ))  # fmt: skip
    return plan


def segment_model(model: onnx.ModelProto, segment: Segment, types: dict[str, onnx.TypeProto],
                  functions: list[onnx.FunctionProto] = ()) -> onnx.ModelProto:  # fmt: skip
    """A standalone model of one segment (same opsets and IR version; initializers stay external)."""
    graph = helper.make_graph(
        segment.nodes, f"{model.graph.name}.segment{segment.index}",
        [_value_info(i, types) for i in segment.inputs], [_value_info(o, types) for o in segment.outputs],
        segment.initializers,
    )  # fmt: skip
    seg = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(functions),
                            producer_name="moe-export")  # fmt: skip
    seg.ir_version = model.ir_version
    return seg


def lower_for_onnxruntime(graph_path: Path, out_dir: Path) -> list[str]:
    """Write ORT segment graphs + `ort_plan.json` into out_dir; returns the file names written."""
    graph_path, out_dir = Path(graph_path), Path(out_dir)
    model = onnx.load(str(graph_path), load_external_data=False)
    types = _value_types(model)
    fp8_cache = any(v.name.startswith(("mla_cache.", "index_cache.")) and v.type.tensor_type.elem_type == TensorProto.UINT8
                    for v in model.graph.input)  # uint8 pools hold fp8 rows
    plan: list[PlanStep] = []
    written: list[str] = []
    for step in plan_segments(model):
        if isinstance(step, CollectiveStep):
            plan.append(step)
            continue
        funcs = [ort_function(op, fp8_cache) for op in sorted({n.op_type for n in step.nodes if n.domain == DOMAIN})]
        name = f"ort_segment_{step.index:03d}.onnx"
        seg = segment_model(model, step, types, funcs)
        (out_dir / name).write_bytes(seg.SerializeToString(deterministic=True))
        written.append(name)
        plan.append(SegmentStep(name, tuple(step.inputs), tuple(step.outputs)))
    written.append(OrtPlan(tuple(plan), tuple(v.name for v in model.graph.output)).write(out_dir))
    return written


def run_lower(ctx, n: int, mapping) -> tuple[list[str], Any, None]:
    """Stage `lower` of rank n (`ctx`: a `build.stages.BuildContext`): lower into a scratch folder that sees the
    weights under their name, then rename the files out."""
    rdir = ctx.state.build / f"rank{n}"
    graph = ctx.state.output(f"graph/rank{n}", f"rank{n}/{GRAPH}")
    weights = ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")
    with scratch(rdir, "lower", {WEIGHTS: weights}) as tmp, ctx.progress.task(f"lower rank {n}", tmp):
        names = list(ctx.stages.work("lower", lower_for_onnxruntime)(graph, tmp))
        bad = [x for x in names if Path(x).name != x or x in (WEIGHTS, GRAPH, QUANT_REPORT) or not (tmp / x).is_file()]
        if bad:
            raise BuildError(f"lower rank {n}: the lowering reported unusable file names {bad}")
        for name in names:
            move_into(tmp / name, rdir / name)
    return [f"rank{n}/{x}" for x in sorted(names)], {"files": sorted(names)}, None


BACKEND = Backend(
    name="onnxruntime",
    graph_form=GraphForm(TensorProto.FLOAT),
    rank_stage=BackendStage("lower", fields=(), libraries=("onnx", "onnxruntime", "onnx-ir", "numpy"), run=run_lower,
                            code=(("export", "backends/onnxruntime.py"), ("plugins", "*.py"),
                                  ("plugins", "*/onnx_schema.py"), ("plugins", "*/ort.py"))),
)

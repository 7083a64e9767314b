"""`rank{N}/ort_plan.json`: the ONNX Runtime backend's contract between its lowering (`export/backends/onnxruntime.py`
writes it) and its runner (`runtime/engine/ort.py` reads it): a rank's graph cut at its collectives, in order.

    {"steps": [{"segment": file, "inputs": [...], "outputs": [...]},
               {"collective": op, "group": g, "input": x, "output": y[, "axis": a]}, ...],
     "graph_outputs": [...]}

MoEDispatch / MoECombine steps also list every input and output in node order ("inputs" / "outputs"), and the
dispatch its "num_experts". Read and written here only (`OrtPlan.read` / `OrtPlan.write`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moe_export.common.errors import InputError

ORT_PLAN = "ort_plan.json"
ALL_TO_ALL = ("MoEDispatch", "MoECombine")  # collectives exchanging rows with every rank of the ep group


@dataclass(frozen=True)
class SegmentStep:
    """One ONNX Runtime session: the segment's file in the rank folder, the values it reads and hands on."""

    segment: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"segment": self.segment, "inputs": list(self.inputs), "outputs": list(self.outputs)}


@dataclass(frozen=True)
class CollectiveStep:
    """One collective node between segments: `op` (AllReduce, AllGather, MoEDispatch, MoECombine) over the `group`
    ("tp" or "ep") from value `input` to value `output`; AllGather's `axis`; the all-to-alls' every input and output
    in node order (`inputs` / `outputs`, else empty) and the dispatch's `num_experts`."""

    op: str
    input: str
    output: str
    group: str | None = None
    axis: int | None = None
    num_experts: int | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    @property
    def all_to_all(self) -> bool:
        return self.op in ALL_TO_ALL

    def to_dict(self) -> dict:
        out = {"collective": self.op, "input": self.input, "output": self.output}
        out.update({k: v for k, v in (("group", self.group), ("axis", self.axis), ("num_experts", self.num_experts))
                    if v is not None})
        if self.inputs or self.outputs:
            out.update(inputs=list(self.inputs), outputs=list(self.outputs))
        return out


PlanStep = SegmentStep | CollectiveStep


@dataclass(frozen=True)
class OrtPlan:
    """A rank's steps in order, and its graph's outputs."""

    steps: tuple[PlanStep, ...]
    graph_outputs: tuple[str, ...] = field(default=())

    def write(self, rank_dir: Path) -> str:
        """Write `ort_plan.json` into rank_dir; its file name."""
        data = {"steps": [s.to_dict() for s in self.steps], "graph_outputs": list(self.graph_outputs)}
        (Path(rank_dir) / ORT_PLAN).write_text(json.dumps(data, indent=1, sort_keys=True))
        return ORT_PLAN

    @classmethod
    def read(cls, rank_dir: Path) -> OrtPlan:
        """The plan of a rank folder; InputError naming the file and the step when it is missing or malformed."""
        path = Path(rank_dir) / ORT_PLAN
        if not path.is_file():
            raise InputError(f"{rank_dir}: no {ORT_PLAN} (was this engine built with backend onnxruntime?)")
        try:
            data = json.loads(path.read_text())
            raw_steps = data["steps"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}: not an ORT plan ({type(exc).__name__}: {exc})") from None
        steps = []
        for k, s in enumerate(raw_steps):
            try:
                steps.append(_step(s))
            except (KeyError, TypeError, ValueError) as exc:
                raise InputError(f"{path}: step {k} is malformed ({type(exc).__name__}: {exc}): {s!r}") from None
        return cls(tuple(steps), tuple(data.get("graph_outputs", ())))


def _step(s: dict) -> PlanStep:
    if "segment" in s:
        return SegmentStep(str(s["segment"]), tuple(s["inputs"]), tuple(s["outputs"]))
    axis, num_experts = s.get("axis"), s.get("num_experts")
    return CollectiveStep(op=str(s["collective"]), input=str(s["input"]), output=str(s["output"]), group=s.get("group"),
                          axis=None if axis is None else int(axis),
                          num_experts=None if num_experts is None else int(num_experts),
                          inputs=tuple(s.get("inputs", ())), outputs=tuple(s.get("outputs", ())))

"""`common/ort_plan.py`: the ONNX Runtime plan read and written in one place, every field of every step kind
surviving the file, and a bad plan refused with the file and the step named."""

import json

import pytest
from moe_export.common.errors import InputError
from moe_export.common.ort_plan import ORT_PLAN, CollectiveStep, OrtPlan, SegmentStep

PLAN = OrtPlan(
    steps=(
        SegmentStep("ort_segment_000.onnx", ("input_ids", "positions"), ("h.0",)),
        CollectiveStep("AllReduce", "h.0", "h.0.sum", group="tp"),
        CollectiveStep("AllGather", "x.1", "x.1.token_all_gather", group="tp", axis=0),
        CollectiveStep("MoEDispatch", "x.2", "recv.2", group="ep", num_experts=8,
                       inputs=("x.2", "ids.2", "w.2"), outputs=("recv.2", "rids.2", "rw.2", "rows.2", "sc.2", "rc.2")),
        SegmentStep("ort_segment_001.onnx", ("recv.2", "rids.2", "rw.2"), ("y.2",)),
        CollectiveStep("MoECombine", "y.2", "out.2", group="ep",
                       inputs=("y.2", "rows.2", "sc.2", "rc.2", "x.2"), outputs=("out.2",)),
    ),
    graph_outputs=("logits",),
)


def test_plan_round_trips_through_its_file(tmp_path):
    assert PLAN.write(tmp_path) == ORT_PLAN
    assert OrtPlan.read(tmp_path) == PLAN
    steps = json.loads((tmp_path / ORT_PLAN).read_text())["steps"]
    assert steps[1] == {"collective": "AllReduce", "input": "h.0", "output": "h.0.sum", "group": "tp"}  # no nulls
    assert [s.all_to_all for s in PLAN.steps if isinstance(s, CollectiveStep)] == [False, False, True, True]


def test_missing_and_malformed_plans_are_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="no ort_plan.json .*backend onnxruntime"):
        OrtPlan.read(tmp_path)
    (tmp_path / ORT_PLAN).write_text(json.dumps({"steps": [{"segment": "a.onnx", "inputs": []}]}))
    with pytest.raises(InputError, match=r"ort_plan.json: step 0 is malformed .*outputs"):
        OrtPlan.read(tmp_path)
    (tmp_path / ORT_PLAN).write_text("[1, 2]")
    with pytest.raises(InputError, match="ort_plan.json: not an ORT plan"):
        OrtPlan.read(tmp_path)

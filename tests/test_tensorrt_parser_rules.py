"""TensorRT-form rank graphs against the ONNX parser's rules (`tests/tensorrt_parser_rules.py`): tiny-k3 in the tp
and dp layouts and tiny-k3-dsa, all with kv_cache fp8, hold no op or type the parser refuses; the rules refuse
what the parser refuses (Cast to FP8, a per-row Q/DQ scale of dynamic shape, UINT8 quantization, an op without an
importer), each naming its contract and onnx-tensorrt source."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from tensorrt_parser_rules import OPERATORS, parser_refusals
from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: real tiny rank graphs)


def test_tensorrt_graphs_hold_nothing_the_parser_refuses(tiny_graphs):  # noqa: F811
    for path in tiny_graphs[2:]:  # tiny-k3-dsa tp, tiny-k3 tp, tiny-k3 dp: backend tensorrt, kv_cache fp8
        model = onnx.load(str(path), load_external_data=False)
        ops = {n.op_type for n in model.graph.node}
        assert {"QuantizeLinear", "DequantizeLinear", "PagedCacheWrite"} <= ops  # the fp8 cache rows are rounded
        assert parser_refusals(model) == [], path


def _graph(nodes, inputs, output, inits=()):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, [output], list(inits)),
                             opset_imports=[helper.make_opsetid("", 21)])  # fmt: skip


def test_rules_refuse_what_the_parser_refuses():
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["T", 8])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", 8])
    cast = _graph([helper.make_node("Cast", ["rows"], ["c"], to=TensorProto.FLOAT8E4M3FN, name="to_fp8"),
                   helper.make_node("Cast", ["c"], ["out"], to=TensorProto.FLOAT, name="back")], [rows], out)
    refusals = parser_refusals(cast)
    assert len(refusals) == 2 and "CAST_TO_FP8_REJECTED" in refusals[0] and "onnxOpImporters.cpp:390" in refusals[0]
    assert "input type FP8" in refusals[1]  # FP8 is no type of Cast's input either (docs/operators.md:40)
    # a per-row scale [T] (what a direct Q/DQ of the row exponent would need): dynamic shape, refused
    zero = helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0])
    scale = helper.make_node("ReduceMax", ["rows"], ["scale"], keepdims=0, axes=None, name="amax")
    per_row = _graph([scale, helper.make_node("QuantizeLinear", ["rows", "scale", "zero"], ["q"], axis=0, name="q"),
                      helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["out"], axis=0, name="dq")],
                     [rows], out, [zero])  # fmt: skip
    per_row.graph.node[0].ClearField("attribute")
    per_row.graph.node[0].attribute.extend([helper.make_attribute("keepdims", 0)])
    per_row.graph.node[0].input.append("axis1")
    per_row.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    assert [r.split(":")[0] for r in parser_refusals(per_row)] == ["QuantizeLinear q", "DequantizeLinear dq"]
    assert all("QDQ_STATIC_SYMMETRIC" in r and "onnxOpImporters.cpp:1418" in r for r in parser_refusals(per_row))
    # uint8 (asymmetric ONNX default) quantization, and an op without an importer
    unit = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "unit")
    u8 = onnx.numpy_helper.from_array(np.array(0, np.uint8), "u8")
    asym = _graph([helper.make_node("QuantizeLinear", ["rows", "unit", "u8"], ["q"], name="q"),
                   helper.make_node("DequantizeLinear", ["q", "unit", "u8"], ["out"], name="dq")], [rows], out, [unit, u8])
    assert all("UINT8 quantization" in r for r in parser_refusals(asym)) and len(parser_refusals(asym)) == 2
    assert OPERATORS["BitShift"][1] is None
    assert "no builtin importer" in parser_refusals(_graph([helper.make_node("BitwiseNot", ["i"], ["o"], name="n")],
        [helper.make_tensor_value_info("i", TensorProto.INT32, [2])], helper.make_tensor_value_info("o", TensorProto.INT32, [2])))[0]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_unit_scale_qdq_rounds_like_cast_in_onnxruntime(seed):
    """The Q/DQ pair of unit scale the exporter uses gives, in ONNX Runtime, exactly the E4M3 rounding of the Cast
    pair it replaces (saturating, nearest even), on values of every E4M3 magnitude."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 97)) * np.exp2(rng.integers(-12, 9, (64, 1)))).astype(np.float32).clip(-448, 448)
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["T", 97])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", 97])
    cast = _graph([helper.make_node("Cast", ["rows"], ["c"], to=TensorProto.FLOAT8E4M3FN),
                   helper.make_node("Cast", ["c"], ["out"], to=TensorProto.FLOAT)], [rows], out)
    unit = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "unit")
    zero = helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0])
    qdq = _graph([helper.make_node("QuantizeLinear", ["rows", "unit", "zero"], ["q"], saturate=1),
                  helper.make_node("DequantizeLinear", ["q", "unit", "zero"], ["out"])], [rows], out, [unit, zero])
    run = [onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"rows": x})[0]
           for m in (cast, qdq)]  # fmt: skip
    assert np.array_equal(run[0], run[1]) and not np.array_equal(run[0], x)

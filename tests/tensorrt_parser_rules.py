"""What TensorRT's ONNX parser (and the layers it makes) refuse in a graph's standard ops, as rules citing
onnx-tensorrt @ 96e78110 (contracts PARSER_OPERATORS, CAST_TO_FP8_REJECTED, QDQ_STATIC_SYMMETRIC in
`moe_export.plugins.tensorrt_contracts`). Our own domain's ops are plugins (checked by tests/tensorrt_standin.py).

`parser_refusals(model)` lists every refusal of a shape-inferred model: an op the matrix marks unsupported or
does not list, an input type outside the op's listed types, a Cast / CastLike to FP8, a Q/DQ whose scale has a
dynamic shape or that is not a symmetric FP8 / INT8 / INT4 quantization.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

# onnx-tensorrt docs/operators.md @ 96e78110: op -> (line, input types it lists), None where marked unsupported.
OPERATORS = {
    "Abs": (19, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Acos": (20, ('FP32', 'FP16', 'BF16')),
    "Acosh": (21, ('FP32', 'FP16', 'BF16')), "Add": (22, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "AffineGrid": (23, None), "And": (24, ('BOOL',)), "ArgMax": (25, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ArgMin": (26, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Asin": (27, ('FP32', 'FP16', 'BF16')),
    "Asinh": (28, ('FP32', 'FP16', 'BF16')), "Atan": (29, ('FP32', 'FP16', 'BF16')),
    "Atanh": (30, ('FP32', 'FP16', 'BF16')), "AveragePool": (31, ('FP32', 'FP16', 'BF16')),
    "BatchNormalization": (32, ('FP32', 'FP16', 'BF16')), "Bernoulli": (33, None), "BitShift": (34, None),
    "BitwiseAnd": (35, None), "BitwiseNot": (36, None), "BitwiseOr": (37, None), "BitwiseXor": (38, None),
    "BlackmanWindow": (39, None), "Cast": (40, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'UINT8', 'BOOL')),
    "CastLike": (41, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'UINT8', 'BOOL')),
    "Ceil": (42, ('FP32', 'FP16', 'BF16')), "Col2Im": (43, None), "Celu": (44, ('FP32', 'FP16', 'BF16')),
    "CenterCropPad": (45, None), "Clip": (46, ('FP32', 'FP16', 'BF16')), "Compress": (47, None),
    "Concat": (48, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "ConcatFromSequence": (49, None),
    "Constant": (50, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "ConstantOfShape": (51, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Conv": (52, ('FP32', 'FP16', 'BF16')), "ConvInteger": (53, None), "ConvTranspose": (54, ('FP32', 'FP16', 'BF16')),
    "Cos": (55, ('FP32', 'FP16', 'BF16')), "Cosh": (56, ('FP32', 'FP16', 'BF16')),
    "CumSum": (57, ('FP32', 'FP16', 'BF16')), "DFT": (58, None), "DeformConv": (59, ('FP32', 'FP16')),
    "DepthToSpace": (60, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "DequantizeLinear": (61, ('INT8', 'FP8', 'INT4')), "Det": (62, None),
    "Div": (63, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Dropout": (64, ('FP32', 'FP16', 'BF16')),
    "DynamicQuantizeLinear": (65, None), "Einsum": (66, ('FP32', 'FP16', 'BF16')),
    "Elu": (67, ('FP32', 'FP16', 'BF16')), "Equal": (68, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Erf": (69, ('FP32', 'FP16', 'BF16')), "Exp": (70, ('FP32', 'FP16', 'BF16')),
    "Expand": (71, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "EyeLike": (72, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Flatten": (73, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "Floor": (74, ('FP32', 'FP16', 'BF16')),
    "Gather": (75, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "GatherElements": (76, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "GatherND": (77, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Gelu": (78, ('FP32', 'FP16', 'BF16', 'INT8', 'INT32', 'INT64')), "Gemm": (79, ('FP32', 'FP16', 'BF16')),
    "GlobalAveragePool": (80, ('FP32', 'FP16', 'BF16')), "GlobalLpPool": (81, ('FP32', 'FP16', 'BF16')),
    "GlobalMaxPool": (82, ('FP32', 'FP16', 'BF16')), "Greater": (83, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "GreaterOrEqual": (84, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "GridSample": (85, ('FP32', 'FP16')),
    "GroupNormalization": (86, ('FP32', 'FP16', 'BF16')), "GRU": (87, ('FP32', 'FP16', 'BF16')),
    "HammingWindow": (88, None), "HannWindow": (89, None), "HardSigmoid": (90, ('FP32', 'FP16', 'BF16')),
    "HardSwish": (91, ('FP32', 'FP16', 'BF16')), "Hardmax": (92, ('FP32', 'FP16', 'BF16')),
    "Identity": (93, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "If": (94, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "ImageScaler": (95, ('FP32', 'FP16', 'BF16')),
    "ImageDecoder": (96, None), "InstanceNormalization": (97, ('FP32', 'FP16', 'BF16')),
    "IsInf": (98, ('FP32', 'FP16', 'BF16')), "IsNaN": (99, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "LayerNormalization": (100, ('FP32', 'FP16', 'BF16')), "LeakyRelu": (101, ('FP32', 'FP16', 'BF16')),
    "Less": (102, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "LessOrEqual": (103, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Log": (104, ('FP32', 'FP16', 'BF16')),
    "LogSoftmax": (105, ('FP32', 'FP16', 'BF16')), "Loop": (106, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "LRN": (107, ('FP32', 'FP16', 'BF16')), "LSTM": (108, ('FP32', 'FP16', 'BF16')),
    "LpNormalization": (109, ('FP32', 'FP16', 'BF16')), "LpPool": (110, ('FP32', 'FP16', 'BF16')),
    "MatMul": (111, ('FP32', 'FP16', 'BF16')), "MatMulInteger": (112, None),
    "Max": (113, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "MaxPool": (114, ('FP32', 'FP16', 'BF16')),
    "MaxRoiPool": (115, None), "MaxUnpool": (116, None),
    "Mean": (117, ('FP32', 'FP16', 'BF16', 'FP8', 'INT32', 'INT64')),
    "MeanVarianceNormalization": (118, ('FP32', 'FP16', 'BF16')), "MelWeightMatrix": (119, None),
    "Min": (120, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Mish": (121, ('FP32', 'FP16')),
    "Mod": (122, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Mul": (123, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Multinomial": (124, None), "Neg": (125, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "NegativeLogLikelihoodLoss": (126, None), "NonMaxSuppression": (127, ('FP32', 'FP16')), "NonZero": (128, ()),
    "Not": (129, ('BOOL',)), "OneHot": (130, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Optional": (131, None), "OptionalGetElement": (132, None), "OptionalHasElement": (133, None),
    "Or": (134, ('BOOL',)), "Pad": (135, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ParametricSoftplus": (136, ('FP32', 'FP16', 'BF16')), "Pow": (137, ('FP32', 'FP16', 'BF16')),
    "PRelu": (138, ('FP32', 'FP16', 'BF16')), "QLinearConv": (139, None), "QLinearMatMul": (140, None),
    "QuantizeLinear": (141, ('FP32', 'FP16', 'BF16')), "RandomNormal": (142, ('FP32', 'FP16', 'BF16')),
    "RandomNormalLike": (143, ('FP32', 'FP16', 'BF16')), "RandomUniform": (144, ('FP32', 'FP16', 'BF16')),
    "RandomUniformLike": (145, ('FP32', 'FP16', 'BF16')), "Range": (146, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Reciprocal": (147, ('FP32', 'FP16', 'BF16')), "ReduceL1": (148, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceL2": (149, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceLogSum": (150, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceLogSumExp": (151, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceMax": (152, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceMean": (153, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceMin": (154, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceProd": (155, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceSum": (156, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ReduceSumSquare": (157, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "RegexFullMatch": (158, None),
    "Relu": (159, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Reshape": (160, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "Resize": (161, ('FP32', 'FP16', 'BF16')),
    "ReverseSequence": (162, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "RNN": (163, ('FP32', 'FP16', 'BF16')), "RoiAlign": (164, ('FP32', 'FP16')),
    "Round": (165, ('FP32', 'FP16', 'BF16')), "STFT": (166, None), "ScaledTanh": (167, ('FP32', 'FP16', 'BF16')),
    "Scan": (168, ('FP32', 'FP16', 'BF16')), "Scatter": (169, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ScatterElements": (170, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "ScatterND": (171, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Selu": (172, ('FP32', 'FP16', 'BF16')),
    "SequenceAt": (173, None), "SequenceConstruct": (174, None), "SequenceEmpty": (175, None),
    "SequenceErase": (176, None), "SequenceInsert": (177, None), "SequenceLength": (178, None),
    "SequenceMap": (179, None), "Shape": (180, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Shrink": (181, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Sigmoid": (182, ('FP32', 'FP16', 'BF16')),
    "Sign": (183, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Sin": (184, ('FP32', 'FP16', 'BF16')),
    "Sinh": (185, ('FP32', 'FP16', 'BF16')), "Size": (186, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Slice": (187, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "Softmax": (188, ('FP32', 'FP16', 'BF16')),
    "SoftmaxCrossEntropyLoss": (189, None), "Softplus": (190, ('FP32', 'FP16', 'BF16')),
    "Softsign": (191, ('FP32', 'FP16', 'BF16')), "SpaceToDepth": (192, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Split": (193, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "SplitToSequence": (194, None),
    "Sqrt": (195, ('FP32', 'FP16', 'BF16')), "Squeeze": (196, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "StringConcat": (197, None), "StringNormalizer": (198, None), "StringSplit": (199, None),
    "Sub": (200, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')), "Sum": (201, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Tan": (202, ('FP32', 'FP16', 'BF16')), "Tanh": (203, ('FP32', 'FP16', 'BF16')), "TfIdfVectorizer": (204, None),
    "ThresholdedRelu": (205, ('FP32', 'FP16', 'BF16')),
    "Tile": (206, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "TopK": (207, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64')),
    "Transpose": (208, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Trilu": (209, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')), "Unique": (210, None),
    "Unsqueeze": (211, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Upsample": (212, ('FP32', 'FP16', 'BF16')), "Where": (213, ('FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL')),
    "Xor": (214, ()),
}  # fmt: skip

TYPE_NAMES = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
              TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.INT8: "INT8",
              TensorProto.UINT8: "UINT8", TensorProto.BOOL: "BOOL", TensorProto.FLOAT8E4M3FN: "FP8",
              TensorProto.INT4: "INT4", TensorProto.DOUBLE: "DOUBLE"}  # fmt: skip
QUANTIZED = ("FP8", "INT8", "INT4")
SOURCE = "onnx-tensorrt @ 96e78110"


def value_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, list]]:
    """({value: ONNX element type}, {value: dims (int or name)}) of a model after shape inference (our domain's
    schemas registered)."""
    from moe_export.plugins.registry import register_all_schemas

    register_all_schemas()
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    g = inferred.graph
    infos = [*g.input, *g.value_info, *g.output]
    types = {v.name: v.type.tensor_type.elem_type for v in infos}
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                     for d in v.type.tensor_type.shape.dim] for v in infos}  # fmt: skip
    for t in g.initializer:
        types[t.name], dims[t.name] = t.data_type, list(t.dims)
    return types, dims


def _cast_refusal(node, types) -> str | None:
    attrs = {a.name: a for a in node.attribute}
    to = attrs["to"].i if node.op_type == "Cast" else types.get(node.input[1])
    if TYPE_NAMES.get(to) not in OPERATORS[node.op_type][1]:
        return (f"{node.op_type} {node.name} to {TYPE_NAMES.get(to, to)}: CAST_TO_FP8_REJECTED ({SOURCE} "
                "onnxOpImporters.cpp:390, docs/operators.md:40-41)")
    return None


def _qdq_refusal(node, types, dims) -> str | None:
    if any(not isinstance(d, int) for d in dims.get(node.input[1], ["?"])):
        return (f"{node.op_type} {node.name}: scale {node.input[1]} of dynamic shape: QDQ_STATIC_SYMMETRIC "
                f"({SOURCE} onnxOpImporters.cpp:1418)")
    coded = node.input[0] if node.op_type == "DequantizeLinear" else (node.input[2] if len(node.input) > 2 else None)
    kind = TYPE_NAMES.get(types.get(coded), "INT8") if coded else "INT8"
    if kind not in QUANTIZED:
        return (f"{node.op_type} {node.name}: {kind} quantization: QDQ_STATIC_SYMMETRIC ({SOURCE} "
                "onnxOpImporters.cpp:1349, :1593-1596)")
    return None


def node_refusal(node, types: dict, dims: dict, initializers: dict) -> str | None:
    """Why the parser refuses `node` (a default-domain op), or None."""
    entry = OPERATORS.get(node.op_type)
    if entry is None or entry[1] is None:
        where = f"docs/operators.md:{entry[0]}" if entry else "not in docs/operators.md"
        return (f"{node.op_type} {node.name}: no builtin importer ({where}), and no plugin of that name: "
                f"PARSER_OPERATORS ({SOURCE} ModelImporter.cpp:166-167)")
    if node.op_type in ("Cast", "CastLike"):
        refusal = _cast_refusal(node, types)
        if refusal:
            return refusal
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        refusal = _qdq_refusal(node, types, dims)
        if refusal:
            return refusal
        zero = initializers.get(node.input[2]) if len(node.input) > 2 else None
        if zero is not None and onnx.numpy_helper.to_array(zero).astype("float32").any():
            return f"{node.op_type} {node.name}: zero point not 0: QDQ_STATIC_SYMMETRIC ({SOURCE} onnxOpImporters.cpp:1492)"
    if node.input and node.input[0]:
        name = TYPE_NAMES.get(types.get(node.input[0]), str(types.get(node.input[0])))
        if name not in entry[1]:
            return (f"{node.op_type} {node.name}: input type {name} not among {list(entry[1])}: PARSER_OPERATORS "
                    f"({SOURCE} docs/operators.md:{entry[0]})")
    return None


def parser_refusals(model: onnx.ModelProto) -> list[str]:
    """Every refusal of the parser rules in `model`'s default-domain nodes (empty: it parses)."""
    types, dims = value_types(model)
    initializers = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        refusal = node_refusal(node, types, dims, initializers)
        if refusal:
            out.append(refusal)
    return out

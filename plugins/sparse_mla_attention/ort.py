"""ONNX Runtime lowering of SparseMLAAttention: a model-local FunctionProto (domain DOMAIN, same op type) whose
body is standard ONNX (opset 21); ORT inlines it. The TensorRT graph keeps the bare node instead.

Body: token -> slot (compare token ids with cu_seqlens), gather the K indexed latent rows per token from the
flattened pool [S*L, Dc+Dr], scores = q_lat @ rows^T * scale, masked softmax (invalid = index < 0 or > position;
a row with nothing valid gives zeros), o_lat = p @ rows[..., :Dc].

Optional input: an ONNX function cannot branch on whether an optional input was given (ORT's inliner rejects
`Optional`/`OptionalHasElement` on a missing function input, checked with ORT 1.32), so there are two bodies
with the same op type and the same six formal inputs: `function_proto(dense=False)` reads `topk_indices`
(and, through an `If`, treats K = 0 columns as dense); `function_proto(dense=True)` ignores it. Dense attends
to all positions 0..L-1 of the slot (causality masks the rest; memory T*L*(Dc+Dr), fine for small models).
A model holds one function per op type, so the exporter picks the variant per model; a model mixing dense
and sparse layers uses the sparse body and gives its dense layers an empty [T, 0] (or [0, 0]) index tensor.
"""

import onnx
from onnx import TensorProto, helper

from .. import DOMAIN
from .onnx_schema import OP_TYPE

ONNX_OPSET = 21
_INT64_MAX = 2**63 - 1


class FunctionBuilder:
    """Collects the nodes of a FunctionProto body; every method returns the new value name(s)."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = prefix
        self._count = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs):
        """Append one standard-domain node; returns its output name (or list when outputs > 1).
        `out` names the (single) output, e.g. a function output."""
        self._count += 1
        names = [out] if out else [f"{self._prefix}_{op_type}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def ints(self, values: list[int]) -> str:
        """1-D int64 constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.INT64, [len(values)], values))

    def int_scalar(self, value: int) -> str:
        """0-D int64 constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.INT64, [], [value]))

    def float_scalar(self, value: float) -> str:
        """0-D float constant."""
        return self.op("Constant", value=helper.make_tensor("v", TensorProto.FLOAT, [], [value]))

    def attr(self, name: str, kind: str) -> str:
        """0-D constant taken from the calling node's attribute `name`; kind is "float", "int" or "string"."""
        attr_type = {
            "float": onnx.AttributeProto.FLOAT,
            "int": onnx.AttributeProto.INT,
            "string": onnx.AttributeProto.STRING,
        }[kind]
        node = helper.make_node("Constant", [], [f"{self._prefix}_attr_{name}"])
        ref = onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=name, type=attr_type)
        node.attribute.append(ref)
        self.nodes.append(node)
        return node.output[0]

    def dim(self, value: str, axis: int) -> str:
        """0-D int64: size of `value` along `axis`."""
        return self.op("Squeeze", self.op("Shape", value, start=axis, end=axis + 1), self.ints([0]))

    def token_slots(self, num_tokens: str, cu_seqlens: str, slot_ids: str) -> str:
        """[T] int64 cache slot of each packed token: slot_ids[#{n : cu_seqlens[n+1] <= t}]."""
        tokens = self.op("Range", self.int_scalar(0), num_tokens, self.int_scalar(1))
        tail = self.op("Slice", cu_seqlens, self.ints([1]), self.ints([_INT64_MAX]))
        passed = self.op(
            "GreaterOrEqual", self.op("Unsqueeze", tokens, self.ints([1])), self.op("Unsqueeze", tail, self.ints([0]))
        )
        seq = self.op("ReduceSum", self.op("Cast", passed, to=TensorProto.INT64), self.ints([1]), keepdims=0)
        return self.op("Gather", slot_ids, seq)

    def masked_softmax(self, scores: str, valid: str, axis: int = -1) -> str:
        """Softmax of `scores` over `axis` where `valid` (broadcast); entries outside get 0, all-invalid rows 0."""
        masked = self.op("Where", valid, scores, self.float_scalar(float("-inf")))
        axes = self.ints([axis])
        row_max = self.op("ReduceMax", masked, axes, keepdims=1)
        row_max = self.op("Where", self.op("IsInf", row_max), self.float_scalar(0.0), row_max)
        expo = self.op("Exp", self.op("Sub", masked, row_max))
        denom = self.op("ReduceSum", expo, axes, keepdims=1)
        denom = self.op("Where", self.op("Greater", denom, self.float_scalar(0.0)), denom, self.float_scalar(1.0))
        return self.op("Div", expo, denom)


def _identity_graph(source: str, name: str) -> onnx.GraphProto:
    """If-branch returning outer-scope value `source` [?, ?] int64 as `name`."""
    out = helper.make_tensor_value_info(name, TensorProto.INT64, [None, None])
    return helper.make_graph([helper.make_node("Identity", [source], [name])], name, [], [out])


def function_proto(dense: bool = False) -> onnx.FunctionProto:
    """FunctionProto for SparseMLAAttention; `dense=True` gives the body that ignores `topk_indices`."""
    b = FunctionBuilder("smla")
    q, kv, cu, slots_in, pos = "q_lat", "kv_cache", "cu_seqlens", "slot_ids", "positions"
    num_tokens = b.dim(q, 0)
    max_len = b.dim(kv, 1)
    slots = b.token_slots(num_tokens, cu, slots_in)
    span = b.op("Range", b.int_scalar(0), max_len, b.int_scalar(1))
    dense_shape = b.op("Concat", b.op("Shape", pos), b.op("Shape", span), axis=0)
    dense_idx = b.op("Expand", b.op("Unsqueeze", span, b.ints([0])), dense_shape)  # [T, L]
    if dense:
        idx = dense_idx
    else:
        given = _identity_graph("topk_indices", "smla_given_idx")
        all_pos = _identity_graph(dense_idx, "smla_dense_idx")
        no_cols = b.op("Equal", b.dim("topk_indices", 1), b.int_scalar(0))
        idx = b.op("If", no_cols, then_branch=all_pos, else_branch=given)
    pos_col = b.op("Unsqueeze", pos, b.ints([1]))
    valid = b.op("And", b.op("GreaterOrEqual", idx, b.int_scalar(0)), b.op("LessOrEqual", idx, pos_col))
    clamped = b.op("Clip", idx, b.int_scalar(0), b.op("Sub", max_len, b.int_scalar(1)))
    rows = b.op("Add", b.op("Mul", b.op("Unsqueeze", slots, b.ints([1])), max_len), clamped)
    gathered = b.op("Gather", b.op("Flatten", kv, axis=2), rows, axis=0)  # [T, K, Dc+Dr]
    scores = b.op("MatMul", q, b.op("Transpose", gathered, perm=[0, 2, 1]))  # [T, H, K]
    scores = b.op("Mul", scores, b.attr("scale", "float"))
    probs = b.masked_softmax(scores, b.op("Unsqueeze", valid, b.ints([1])))
    rank = b.op("Unsqueeze", b.attr("kv_lora_rank", "int"), b.ints([0]))
    values = b.op("Slice", gathered, b.ints([0]), rank, b.ints([2]))
    b.op("MatMul", probs, values, out="o_lat")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["q_lat", "kv_cache", "cu_seqlens", "slot_ids", "positions", "topk_indices"],
        ["o_lat"],
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["scale", "kv_lora_rank"],
    )

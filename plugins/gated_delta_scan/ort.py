"""ONNX Runtime lowering of GatedDeltaScan: a model-local FunctionProto (domain DOMAIN, same op type) whose
body uses standard ONNX ops only (opset 21); ORT inlines it. The TensorRT graph keeps the bare node.

Body (exact fp32 recurrence, same order of operations as ``reference``):
  q, k <- Where(use_qk_l2norm, l2norm(x), x);  q <- q * scale
  states = Gather(state_pool, slot_ids)                              [N, H, V, K]
  if every sequence has exactly one token (a decode step): the token update below over all N at once;
  else an outer Loop over sequences n (carries the packed output so far, scans out the final states):
    slice q, k, v, g, beta to [cu_seqlens[n], cu_seqlens[n+1])
    inner Loop over its tokens (carries S [H, V, K], scans out o_t [H, V]):
      S = S * exp(g_t)[:, None, :];  d = beta_t * (v_t - sum_K S k_t);  S += d[:, :, None] k_t[:, None, :]
      o_t = sum_K S q_t
    o = Concat(o, Reshape(o_seq, [L, H, V]))   (the reshape makes an empty sequence a [0, H, V] block)
  state_pool_out = ScatterND(state_pool, slot_ids[:, None], final states)
Cost: a decode step is ~10 batched kernels on [N, H, V, K]; otherwise one ORT Loop iteration per token (~10 small
kernels on [H, V, K]), fine for tests and small models.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .. import DOMAIN, PLUGIN_VERSION
from .inputs import L2NORM_EPS
from .onnx_schema import INPUTS, OP_TYPE, OUTPUTS

ONNX_OPSET = 21


class _Nodes:
    """Node list with fresh value names; ``op`` returns the output name."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        name = out or f"{self.prefix}{len(self.nodes)}_{op_type}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(self, value, dtype=TensorProto.INT64) -> str:
        """Constant: 1-D for a list, 0-D for a scalar."""
        dims = [len(value)] if isinstance(value, list) else []
        vals = value if isinstance(value, list) else [value]
        return self.op("Constant", value=helper.make_tensor("c", dtype, dims, vals))

    def attr(self, name: str, kind: str, attr_type: int) -> str:
        """0-D Constant holding the calling node's attribute ``name`` (kind: "float" or "int")."""
        node = helper.make_node("Constant", [], [f"{self.prefix}attr_{name}"])
        node.attribute.append(onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=name, type=attr_type))
        self.nodes.append(node)
        return node.output[0]

    def unsq(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", x, self.const(axes))


def _token_body(prefix: str) -> onnx.GraphProto:
    """Inner Loop body: (i, cond, S [H, V, K]) -> (cond, S', o_t [H, V]); reads the outer seq_* slices."""
    b = _Nodes(prefix)
    i, cond, S = f"{prefix}i", f"{prefix}cond", f"{prefix}S"
    q_t = b.op("Gather", "gds_seq_q", i)  # [H, K]
    k_t = b.op("Gather", "gds_seq_k", i)
    v_t = b.op("Gather", "gds_seq_v", i)  # [H, V]
    g_t = b.op("Gather", "gds_seq_g", i)
    beta_t = b.op("Gather", "gds_seq_beta", i)  # [H]
    k_row = b.unsq(k_t, [1])  # [H, 1, K]
    decayed = b.op("Mul", S, b.unsq(b.op("Exp", g_t), [1]))
    kv = b.op("ReduceSum", b.op("Mul", decayed, k_row), b.const([2]), keepdims=0)  # [H, V]
    d = b.op("Mul", b.op("Sub", v_t, kv), b.unsq(beta_t, [1]))
    S_new = b.op("Add", decayed, b.op("Mul", b.unsq(d, [2]), k_row), out=f"{prefix}S_out")
    b.op("ReduceSum", b.op("Mul", S_new, b.unsq(q_t, [1])), b.const([2]), keepdims=0, out=f"{prefix}o_t")
    b.op("Identity", cond, out=f"{prefix}cond_out")
    f32 = TensorProto.FLOAT
    return helper.make_graph(
        b.nodes,
        f"{prefix}body",
        [
            helper.make_tensor_value_info(i, TensorProto.INT64, []),
            helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
            helper.make_tensor_value_info(S, f32, [None, None, None]),
        ],
        [
            helper.make_tensor_value_info(f"{prefix}cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info(f"{prefix}S_out", f32, [None, None, None]),
            helper.make_tensor_value_info(f"{prefix}o_t", f32, [None, None]),
        ],
    )


def _one_token_each_body(prefix: str) -> onnx.GraphProto:
    """If-branch for steps where every sequence has exactly one token (decode: token n is sequence n): the
    token update of `_token_body` over all N at once, no Loop -> (o [N, H, V], final states [N, H, V, K])."""
    b = _Nodes(prefix)
    k_row = b.unsq("gds_k", [2])  # [N, H, 1, K]
    decayed = b.op("Mul", "gds_states", b.unsq(b.op("Exp", "gds_g"), [2]))
    kv = b.op("ReduceSum", b.op("Mul", decayed, k_row), b.const([3]), keepdims=0)  # [N, H, V]
    d = b.op("Mul", b.op("Sub", "gds_v", kv), b.unsq("gds_beta", [2]))
    S_new = b.op("Add", decayed, b.op("Mul", b.unsq(d, [3]), k_row), out=f"{prefix}S")
    b.op("ReduceSum", b.op("Mul", S_new, b.unsq("gds_q", [2])), b.const([3]), keepdims=0, out=f"{prefix}o")
    f32 = TensorProto.FLOAT
    return helper.make_graph(b.nodes, f"{prefix}body", [],
                             [helper.make_tensor_value_info(n, f32, None) for n in (f"{prefix}o", S_new)])  # fmt: skip


def _sequence_body(prefix: str) -> onnx.GraphProto:
    """Outer Loop body: (n, cond, o_acc [?, H, V]) -> (cond, o_acc', S_final [H, V, K])."""
    b = _Nodes(prefix)
    n, cond, o_acc = f"{prefix}n", f"{prefix}cond", f"{prefix}o_acc"
    bos = b.op("Gather", "cu_seqlens", n)
    eos = b.op("Gather", "cu_seqlens", b.op("Add", n, b.const(1)))
    starts, ends, axis0 = b.unsq(bos, [0]), b.unsq(eos, [0]), b.const([0])
    for name in ("q", "k", "v", "g", "beta"):
        b.op("Slice", f"gds_{name}", starts, ends, axis0, out=f"gds_seq_{name}")
    length = b.op("Sub", eos, bos)
    S0 = b.op("Gather", "gds_states", n)  # [H, V, K]
    S_final, o_seq = f"{prefix}S_final", f"{prefix}o_seq"
    b.nodes.append(
        helper.make_node("Loop", [length, "", S0], [S_final, o_seq], body=_token_body(f"{prefix}t_"))
    )
    shape = b.op("Concat", b.unsq(length, [0]), "gds_hv", axis=0)
    o_block = b.op("Reshape", o_seq, shape, allowzero=1)
    b.op("Concat", o_acc, o_block, axis=0, out=f"{prefix}o_acc_out")
    b.op("Identity", cond, out=f"{prefix}cond_out")
    f32 = TensorProto.FLOAT
    return helper.make_graph(
        b.nodes,
        f"{prefix}body",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, []),
            helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
            helper.make_tensor_value_info(o_acc, f32, [None, None, None]),
        ],
        [
            helper.make_tensor_value_info(f"{prefix}cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info(f"{prefix}o_acc_out", f32, [None, None, None]),
            helper.make_tensor_value_info(S_final, f32, [None, None, None]),
        ],
    )


def function_proto() -> onnx.FunctionProto:
    """FunctionProto implementing GatedDeltaScan in opset-21 ONNX (inputs/outputs/attributes as the schema)."""
    b = _Nodes("gds_")
    f32 = TensorProto.FLOAT
    qf = b.op("Cast", "q", to=f32)
    kf = b.op("Cast", "k", to=f32)
    b.op("Cast", "v", to=f32, out="gds_v")
    b.op("Identity", "g", out="gds_g")
    b.op("Identity", "beta", out="gds_beta")
    use_l2 = b.op("Cast", b.attr("use_qk_l2norm", "int", onnx.AttributeProto.INT), to=TensorProto.BOOL)
    eps = b.const(L2NORM_EPS, f32)
    last = b.const([-1])

    def l2(x: str) -> str:
        norm = b.op("Sqrt", b.op("Add", b.op("ReduceSum", b.op("Mul", x, x), last, keepdims=1), eps))
        return b.op("Where", use_l2, b.op("Div", x, norm), x)

    b.op("Mul", l2(qf), b.attr("scale", "float", onnx.AttributeProto.FLOAT), out="gds_q")
    b.op("Identity", l2(kf), out="gds_k")
    b.op("Gather", "state_pool", "slot_ids", axis=0, out="gds_states")  # [N, H, V, K]
    b.op("Slice", b.op("Shape", "v"), b.const([1]), b.const([3]), out="gds_hv")  # [H, V]
    o_empty = b.op("Slice", "gds_v", b.const([0]), b.const([0]), b.const([0]))  # [0, H, V]
    num_seqs = b.op("Squeeze", b.op("Shape", "slot_ids"), b.const([0]))
    o_all, finals = "gds_o_all", "gds_finals"
    diffs = b.op("Sub", b.op("Slice", "cu_seqlens", b.const([1]), b.const([2**62])),
                 b.op("Slice", "cu_seqlens", b.const([0]), b.const([-1])))
    one_each = b.op("Equal", b.op("ReduceMin", b.op("Cast", b.op("Equal", diffs, b.const(1)), to=TensorProto.INT32),
                                  keepdims=0), b.const(1, TensorProto.INT32))  # fmt: skip
    scan = helper.make_graph(
        [helper.make_node("Loop", [num_seqs, "", o_empty], ["gds_scan_o", "gds_scan_finals"],
                          body=_sequence_body("gds_s_"))],
        "gds_scan", [], [helper.make_tensor_value_info(n, f32, None) for n in ("gds_scan_o", "gds_scan_finals")],
    )  # fmt: skip
    b.nodes.append(helper.make_node("If", [one_each], [o_all, finals], then_branch=_one_token_each_body("gds_d_"),
                                    else_branch=scan))  # fmt: skip
    b.op("CastLike", o_all, "v", out="o")
    b.op("ScatterND", "state_pool", b.unsq("slot_ids", [1]), finals, out="state_pool_out")
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        attributes=["scale"],
        attribute_protos=[
            helper.make_attribute("use_qk_l2norm", 0),
            helper.make_attribute("plugin_version", PLUGIN_VERSION),
        ],
    )

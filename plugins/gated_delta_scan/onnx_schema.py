"""ONNX schema of ``GatedDeltaScan`` (domain ``moe_export.plugins.DOMAIN``, opset ``OPSET_VERSION``).

Node contract (semantics: ``reference.gated_delta_scan_node``)::

    o, state_pool_out = GatedDeltaScan(q, k, v, g, beta, state_pool, cu_seqlens, slot_ids)
    inputs   q              [T, H, K]     T1       queries (l2-normalised in the op if use_qk_l2norm)
             k              [T, H, K]     T1       keys
             v              [T, H, V]     T1       values
             g              [T, H, K]     float    log-decay per key channel (K3 safe gate: in (-5, 0))
             beta           [T, H]        float    delta-rule step size (already sigmoid-ed)
             state_pool     [S, H, V, K]  float    recurrent state pool, V-first (K3 / TensorRT layout)
             cu_seqlens     [N+1]         int64    packed sequence boundaries, cu_seqlens[0] = 0, [-1] = T
             slot_ids       [N]           int64    pool slot of each sequence (distinct)
    outputs  o              [T, H, V]     T1       o_t = S_t^T (q_t * scale), S_t the updated state
             state_pool_out [S, H, V, K]  float    state_pool with slots slot_ids[n] replaced by the final
                                                   state of sequence n; other slots unchanged
    attributes  scale          float, required    query scale (K^-0.5 = 128^-0.5 for K3)
                use_qk_l2norm  int, default 0      1: q, k <- x / sqrt(sum_K x^2 + 1e-6) first
                plugin_version string, default "1" TensorRT plugin version
    T1 in {float, float16, bfloat16}; arithmetic and state are fp32. Decode is N sequences of length 1.

``register()`` adds the schema with a Python type-and-shape inference function
(``OpSchema.set_type_and_shape_inference_function``, onnx >= 1.16), so ``onnx.checker.check_model(...,
full_check=True)`` and ``onnx.shape_inference.infer_shapes(..., strict_mode=True)`` accept graphs holding the
bare node: o gets v's type and shape, state_pool_out gets state_pool's. Registration is process-global and
idempotent.
"""

from __future__ import annotations

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import (POOL_TABLE_DOC, plugin_lookup_attributes, pool_table_attributes,
                                            register_once)

OP_TYPE = "GatedDeltaScan"
INPUTS = ("q", "k", "v", "g", "beta", "state_pool", "cu_seqlens", "slot_ids")
OUTPUTS = ("o", "state_pool_out")
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _infer(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(2))
    if ctx.get_num_outputs() > 1:  # ONNX Runtime form; the TensorRT form writes the pool through the pool table
        ctx.set_output_type(1, ctx.get_input_type(5))


def schema() -> defs.OpSchema:
    """The OpSchema of GatedDeltaScan (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Gated delta rule scan (Kimi Delta Attention core) over packed sequences with a slot state pool.",
        inputs=[
            p("q", "T1", "[T, H, K]"),
            p("k", "T1", "[T, H, K]"),
            p("v", "T1", "[T, H, V]"),
            p("g", "tensor(float)", "[T, H, K] log-decay"),
            p("beta", "tensor(float)", "[T, H]"),
            p("state_pool", "P", "[S, H, V, K] float, " + POOL_TABLE_DOC),
            p("cu_seqlens", "tensor(int64)", "[N+1]"),
            p("slot_ids", "tensor(int64)", "[N]"),
        ],
        outputs=[p("o", "T1", "[T, H, V]"),
                 p("state_pool_out", "tensor(float)", "[S, H, V, K] (ONNX Runtime form only)",
                   param_option=defs.OpSchema.FormalParameterOption.Optional)],
        type_constraints=[("T1", _FLOAT_TYPES, "activation type"),
                          ("P", ["tensor(float)", "tensor(int64)"], "the state pool, or the pool table")],
        attributes=[
            defs.OpSchema.Attribute("scale", defs.OpSchema.AttrType.FLOAT, "query scale"),
            defs.OpSchema.Attribute(
                "use_qk_l2norm", helper.make_attribute("use_qk_l2norm", 0), "1: l2-normalise q and k over K"
            ),
            *pool_table_attributes(paged=False),
            *plugin_lookup_attributes(),
        ],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the GatedDeltaScan schema (idempotent)."""
    register_once(schema())


def make_node(
    q: str,
    k: str,
    v: str,
    g: str,
    beta: str,
    state_pool: str,
    cu_seqlens: str,
    slot_ids: str,
    o: str,
    state_pool_out: str,
    *,
    scale: float,
    use_qk_l2norm: bool,
    name: str | None = None,
) -> onnx.NodeProto:
    """A GatedDeltaScan node over the given value names, with every attribute set explicitly."""
    return helper.make_node(
        OP_TYPE,
        [q, k, v, g, beta, state_pool, cu_seqlens, slot_ids],
        [o, state_pool_out],
        name=name,
        domain=DOMAIN,
        scale=float(scale),
        use_qk_l2norm=int(bool(use_qk_l2norm)),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )

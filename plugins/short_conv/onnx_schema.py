"""ONNX schema of ``ShortConv`` (domain ``moe_export.plugins.DOMAIN``, opset ``OPSET_VERSION``).

Node contract (semantics: ``reference.short_conv_node``)::

    y, conv_pool_out = ShortConv(x, weight, conv_pool, cu_seqlens, slot_ids)
    inputs   x              [T, C]        T1      packed inputs of N sequences
             weight         [C, W]        float   depthwise taps, oldest -> newest, no bias (disk [C,1,W])
             conv_pool      [S, C, W-1]   T2      window pool: last W-1 inputs per slot, oldest first
             cu_seqlens     [N+1]         int64   packed sequence boundaries, cu_seqlens[0] = 0, [-1] = T
             slot_ids       [N]           int64   pool slot of each sequence (distinct)
    outputs  y              [T, C]        T1      y_t = silu(sum_j weight[:, j] * x_{t-W+1+j}), reaching
                                                  into the slot's window before the sequence start
             conv_pool_out  [S, C, W-1]   T2      conv_pool with slots slot_ids[n] replaced by the last W-1
                                                  inputs of sequence n (older entries kept when shorter)
    attributes  plugin_version string, default "1" TensorRT plugin version
    T1, T2 in {float, float16, bfloat16}; arithmetic is fp32. Decode is N sequences of length 1.

``register()`` adds the schema with a Python type-and-shape inference function (y gets x's type and shape,
conv_pool_out conv_pool's), so ``onnx.checker.check_model(..., full_check=True)`` and
``onnx.shape_inference.infer_shapes(..., strict_mode=True)`` accept graphs holding the bare node.
Registration is process-global and idempotent.
"""

from __future__ import annotations

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import (POOL_TABLE_DOC, plugin_lookup_attributes, pool_table_attributes,
                                            register_once)

OP_TYPE = "ShortConv"
INPUTS = ("x", "weight", "conv_pool", "cu_seqlens", "slot_ids")
OUTPUTS = ("y", "conv_pool_out")
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _infer(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))
    if ctx.get_num_outputs() > 1:  # ONNX Runtime form; the TensorRT form writes the pool through the pool table
        ctx.set_output_type(1, ctx.get_input_type(2))


def schema() -> defs.OpSchema:
    """The OpSchema of ShortConv (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Causal depthwise convolution + SiLU over packed sequences with a slot window pool.",
        inputs=[
            p("x", "T1", "[T, C]"),
            p("weight", "tensor(float)", "[C, W]"),
            p("conv_pool", "T2", "[S, C, W-1], " + POOL_TABLE_DOC),
            p("cu_seqlens", "tensor(int64)", "[N+1]"),
            p("slot_ids", "tensor(int64)", "[N]"),
        ],
        outputs=[p("y", "T1", "[T, C]"),
                 p("conv_pool_out", "T2", "[S, C, W-1] (ONNX Runtime form only)",
                   param_option=defs.OpSchema.FormalParameterOption.Optional)],
        type_constraints=[("T1", _FLOAT_TYPES, "activation type"),
                          ("T2", [*_FLOAT_TYPES, "tensor(int64)"], "window pool type, or int64: the pool table")],
        attributes=[*pool_table_attributes(paged=False), *plugin_lookup_attributes()],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the ShortConv schema (idempotent)."""
    register_once(schema())


def make_node(
    x: str, weight: str, conv_pool: str, cu_seqlens: str, slot_ids: str, y: str, conv_pool_out: str,
    *, name: str | None = None,
) -> onnx.NodeProto:  # fmt: skip
    """A ShortConv node over the given value names, with ``plugin_version`` set."""
    return helper.make_node(
        OP_TYPE,
        [x, weight, conv_pool, cu_seqlens, slot_ids],
        [y, conv_pool_out],
        name=name,
        domain=DOMAIN,
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )

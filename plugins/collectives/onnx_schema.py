"""ONNX schemas of the collective nodes (domain `moe_export.plugins.DOMAIN`).

    y = AllReduce(x)   attributes: group ("tp" | "ep"), reduce_op ("sum"), plugin_version
        y has x's type and shape; every rank of the group gets the elementwise sum.
    y = AllGather(x)   attributes: group ("tp" | "ep"), axis (int), group_size (int), plugin_version
        y = concat over the group's ranks (in rank order) along `axis`: that dim is group_size times x's
        (shape inference leaves it unknown; TensorRT's plugin computes it from group_size).

The ONNX Runtime backend splits graphs at these nodes (`export/backends.py`) and the runtime performs the
collective between segments (MPI or in process); the TensorRT backend keeps them inside one engine per rank as
plugins that run NCCL (`tensorrt_plugin.py`, `nccl.py`).
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION
from ..sparse_mla_attention.onnx_schema import plugin_lookup_attributes, register_once

COLLECTIVE_OPS = ("AllReduce", "AllGather")
_FLOATS = ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "fp32 on CPU, bf16 in GPU builds")


def _same_type(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))


def _gather_type(ctx) -> None:
    src = ctx.get_input_type(0)
    out = onnx.TypeProto()
    out.CopyFrom(src)
    axis = helper.get_attribute_value(ctx.get_attribute("axis"))
    dims = out.tensor_type.shape.dim
    if len(dims):
        dims[axis % len(dims)].Clear()
    ctx.set_output_type(0, out)


def schemas() -> list[defs.OpSchema]:
    p = defs.OpSchema.FormalParameter
    attr = defs.OpSchema.Attribute
    group = attr("group", defs.OpSchema.AttrType.STRING, "process group: tp or ep")
    reduce = defs.OpSchema(
        "AllReduce", DOMAIN, OPSET_VERSION, "Elementwise sum over the ranks of a group.",
        inputs=[p("x", "T", "any shape")], outputs=[p("y", "T", "same as x")], type_constraints=[_FLOATS],
        attributes=[group, attr("reduce_op", helper.make_attribute("reduce_op", "sum"), "sum"),
                    *plugin_lookup_attributes()],
    )
    reduce.set_type_and_shape_inference_function(_same_type)
    gather = defs.OpSchema(
        "AllGather", DOMAIN, OPSET_VERSION, "Concatenation over the ranks of a group along `axis`.",
        inputs=[p("x", "T", "any shape")], outputs=[p("y", "T", "x with axis grown")], type_constraints=[_FLOATS],
        attributes=[group, attr("axis", defs.OpSchema.AttrType.INT, "concat axis"),
                    attr("group_size", defs.OpSchema.AttrType.INT, "ranks in the group"), *plugin_lookup_attributes()],
    )
    gather.set_type_and_shape_inference_function(_gather_type)
    return [reduce, gather]


def register() -> None:
    """Register both schemas (idempotent)."""
    for s in schemas():
        register_once(s)

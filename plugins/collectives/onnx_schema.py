"""ONNX schemas of the collective nodes (domain `moe_export.plugins.DOMAIN`).

    y = AllReduce(x)   attributes: group ("tp" | "ep"), reduce_op ("sum"), plugin_version
        y has x's type and shape; every rank of the group gets the elementwise sum.
    y = AllGather(x)   attributes: group ("tp" | "ep"), axis (int), plugin_version
        y = concat over the group's ranks (in rank order) along `axis`; that dim becomes unknown here
        (the group size is a property of the mapping, not of the graph).

The ONNX Runtime backend splits graphs at these nodes and the runtime calls MPI (or sums in process);
TensorRT maps them to NCCL plugins (`tensorrt_plugin.py`).
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION
from ..sparse_mla_attention.onnx_schema import plugin_version_attribute, register_once

COLLECTIVE_OPS = ("AllReduce", "AllGather")


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
        inputs=[p("x", "tensor(float)", "any shape")], outputs=[p("y", "tensor(float)", "same as x")],
        attributes=[group, attr("reduce_op", helper.make_attribute("reduce_op", "sum"), "sum"),
                    plugin_version_attribute()],
    )
    reduce.set_type_and_shape_inference_function(_same_type)
    gather = defs.OpSchema(
        "AllGather", DOMAIN, OPSET_VERSION, "Concatenation over the ranks of a group along `axis`.",
        inputs=[p("x", "tensor(float)", "any shape")], outputs=[p("y", "tensor(float)", "x with axis grown")],
        attributes=[group, attr("axis", defs.OpSchema.AttrType.INT, "concat axis"), plugin_version_attribute()],
    )
    gather.set_type_and_shape_inference_function(_gather_type)
    return [reduce, gather]


def register() -> None:
    """Register both schemas (idempotent)."""
    for s in schemas():
        register_once(s)

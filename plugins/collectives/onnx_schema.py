"""ONNX schemas of the collective nodes (domain `moe_export.plugins.DOMAIN`).

    y = AllReduce(x[, after])   attributes: group ("tp" | "ep"), reduce_op ("sum"), plugin_version
        y has x's type and shape; every rank of the group gets the elementwise sum.
    y = AllGather(x[, after])   attributes: group ("tp" | "ep"), axis (int), group_size (int), plugin_version
        y = concat over the group's ranks (in rank order) along `axis`: that dim is group_size times x's
        (shape inference leaves it unknown; TensorRT's plugin computes it from group_size).
    recv_x, recv_ids, recv_w, send_rows, send_counts, recv_counts = MoEDispatch(x, expert_ids, expert_weights[, after])
        attributes: group ("ep"), num_experts (int, global), plugin_version; TensorRT graphs also group_size
        (ep) and max_recv_rows (the static receive bound R_max = ep * ceil(max_num_tokens / tp)). The `dp`
        layout's all-to-all dispatch (`all_to_all.py`): x [T, D] T, expert_ids [T, K] int64 (global),
        expert_weights [T, K] fp32 -> recv_x [R, D] T, recv_ids [R, K] int64, recv_w [R, K] fp32 (rows from each
        source rank, in rank order), send_rows [S] int64 (token index of each row sent, by destination rank),
        send_counts / recv_counts [ep] int64 (rows sent to / received from each rank). Without max_recv_rows
        (ONNX Runtime graphs) R and S are data-dependent (exact); with it R = R_max and S = T * K, the rows past
        the received ones having expert id -1 and weight 0 and send_rows -1 past the sent ones.
    y = MoECombine(partial, send_rows, send_counts, recv_counts, x[, after])
        attributes: group ("ep"), plugin_version. partial [R, D] T (the experts' weighted sums of the received
        rows) goes back to the rows' sources and is summed per token: y [T, D] T, T = x's rows (x: the
        dispatched tokens, only its shape is read).

TensorRT graphs give each of the four one more input, `after` (any float type): the graph's previous collective's first
output (the first collective's: its own first input), never read, only ordering the node after that collective
(`graphs.onnx_builder.GraphBuilder.collective`; contract TRT_ORDERS_BY_DATA_DEPENDENCIES).

The ONNX Runtime backend splits graphs at these nodes (`export/backends/onnxruntime.py`) and the runtime performs the
collective between segments (MPI or in process); the TensorRT backend keeps them inside one engine per rank as
plugins that run NCCL (`tensorrt_plugin.py`, `nccl.py`).
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION
from ..sparse_mla_attention.onnx_schema import plugin_lookup_attributes, register_once

COLLECTIVE_OPS = ("AllReduce", "AllGather", "MoEDispatch", "MoECombine")
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


def _dispatch_types(ctx) -> None:
    """Element types; with max_recv_rows / group_size (TensorRT graphs) the static dims: [R_max, D], [R_max, K]
    twice, [S], [ep] twice (D and K copied from the inputs when known)."""
    x = ctx.get_input_type(0)

    def attr(name: str) -> int | None:
        a = ctx.get_attribute(name)
        return helper.get_attribute_value(a) if a is not None else None

    rows, ep = attr("max_recv_rows"), attr("group_size")
    x_dims, ids_dims = x.tensor_type.shape.dim, ctx.get_input_type(1).tensor_type.shape.dim
    width = x_dims[1] if len(x_dims) == 2 else None
    top_k = ids_dims[1] if len(ids_dims) == 2 else None
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    outputs = [(x.tensor_type.elem_type, [rows, width]), (i64, [rows, top_k]), (f32, [rows, top_k]), (i64, [None]),
               (i64, [ep]), (i64, [ep])]
    for index, (elem, dims) in enumerate(outputs):
        out = onnx.TypeProto()
        out.tensor_type.elem_type = elem
        for d in dims:
            dim = out.tensor_type.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif d is not None:
                dim.CopyFrom(d)
        ctx.set_output_type(index, out)


def _combine_type(ctx) -> None:
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    rows = ctx.get_input_type(4).tensor_type.shape.dim
    dims = out.tensor_type.shape.dim
    if len(dims) == 2 and len(rows):
        dims[0].CopyFrom(rows[0])
    ctx.set_output_type(0, out)


def schemas() -> list[defs.OpSchema]:
    p = defs.OpSchema.FormalParameter
    attr = defs.OpSchema.Attribute
    after = p("after", "A", "TensorRT graphs: the previous collective's first output (ordering only, not read)",
              param_option=defs.OpSchema.FormalParameterOption.Optional)
    any_float = ("A", _FLOATS[1], "`after`: any float type (the previous collective's)")
    group = attr("group", defs.OpSchema.AttrType.STRING, "process group: tp or ep")
    reduce = defs.OpSchema(
        "AllReduce", DOMAIN, OPSET_VERSION, "Elementwise sum over the ranks of a group.",
        inputs=[p("x", "T", "any shape"), after], outputs=[p("y", "T", "same as x")], type_constraints=[_FLOATS, any_float],
        attributes=[group, attr("reduce_op", helper.make_attribute("reduce_op", "sum"), "sum"),
                    *plugin_lookup_attributes()],
    )
    reduce.set_type_and_shape_inference_function(_same_type)
    gather = defs.OpSchema(
        "AllGather", DOMAIN, OPSET_VERSION, "Concatenation over the ranks of a group along `axis`.",
        inputs=[p("x", "T", "any shape"), after], outputs=[p("y", "T", "x with axis grown")], type_constraints=[_FLOATS, any_float],
        attributes=[group, attr("axis", defs.OpSchema.AttrType.INT, "concat axis"),
                    attr("group_size", defs.OpSchema.AttrType.INT, "ranks in the group"), *plugin_lookup_attributes()],
    )
    gather.set_type_and_shape_inference_function(_gather_type)
    i64 = ("I", ["tensor(int64)"], "int64 ids, rows and counts")
    f32 = ("W", ["tensor(float)"], "fp32 routing weights")
    dispatch = defs.OpSchema(
        "MoEDispatch", DOMAIN, OPSET_VERSION, "All-to-all: each token to the ranks of its top-k experts.",
        inputs=[p("x", "T", "[T, D] tokens"), p("expert_ids", "I", "[T, K] global ids"),
                p("expert_weights", "W", "[T, K] routing weights"), after],
        outputs=[p("recv_x", "T", "[R, D]"), p("recv_ids", "I", "[R, K]"), p("recv_w", "W", "[R, K]"),
                 p("send_rows", "I", "[S]"), p("send_counts", "I", "[ep]"), p("recv_counts", "I", "[ep]")],
        type_constraints=[_FLOATS, i64, f32, any_float],
        attributes=[group, attr("num_experts", defs.OpSchema.AttrType.INT, "global routed experts"),
                    attr("group_size", defs.OpSchema.AttrType.INT, "ranks of the ep group (TensorRT graphs)", required=False),
                    attr("max_recv_rows", defs.OpSchema.AttrType.INT, "static receive bound (TensorRT graphs)",
                         required=False),
                    *plugin_lookup_attributes()],
    )
    dispatch.set_type_and_shape_inference_function(_dispatch_types)
    combine = defs.OpSchema(
        "MoECombine", DOMAIN, OPSET_VERSION, "All-to-all back: partial sums to their tokens, summed per token.",
        inputs=[p("partial", "T", "[R, D]"), p("send_rows", "I", "[S]"), p("send_counts", "I", "[ep]"),
                p("recv_counts", "I", "[ep]"), p("x", "T", "[T, D] the dispatched tokens (shape only)"), after],
        outputs=[p("y", "T", "[T, D]")], type_constraints=[_FLOATS, i64, any_float],
        attributes=[group, *plugin_lookup_attributes()],
    )
    combine.set_type_and_shape_inference_function(_combine_type)
    return [reduce, gather, dispatch, combine]


def register() -> None:
    """Register the collectives' schemas (idempotent)."""
    for s in schemas():
        register_once(s)

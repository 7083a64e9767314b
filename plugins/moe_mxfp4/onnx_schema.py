"""ONNX schema of `MoEMXFP4` (domain `moe_export.plugins.DOMAIN`, opset `OPSET_VERSION`).

Node contract (semantics in `reference.py`):

    y = MoEMXFP4(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    inputs   x               [T, D]            T       expert input (K3: the latent, D = 3584); T = float, or
                                                       bfloat16 (TensorRT graphs of bf16 builds)
             expert_ids      [T, k]            int64   global expert ids chosen per token
             expert_weights  [T, k]            float   routing weights
             w13_packed      [E, 2I, D/2]      bytes   MXFP4 gate rows (0..I-1) then up rows (I..2I-1)
             w13_scale       [E, 2I, D/32]     bytes   E8M0 scales
             w2_packed       [E, D, I/2]       bytes   MXFP4 down projection
             w2_scale        [E, D, I/32]      bytes   E8M0 scales
             row_counts      [S]               int64   (TensorRT graphs only) the leading sum(row_counts) rows of x
                                                       carry tokens; the others are neither read nor written
    bytes: uint8, or int8 over the same bytes (TensorRT graphs: its ONNX parser widens uint8 initializers to
    int32, see plugins/tensorrt_contracts.py); all four share one type.
    output   y               [T, D]            T       weighted sum over the choices held by this rank
             scratch         [scratch_bytes]   int8    (TensorRT graphs only) the plugin's workspace: a declared
                                                       output so that it lives in the engine's device memory
    attributes  expert_offset (int, required): global id of local expert 0 (this rank holds E experts)
                activation (string, required): "situ" or "silu"
                situ_beta (float, required): SiTU beta (4.0 for K3; ignored by "silu")
                situ_linear_beta (float, required): SiTU up clamp (25.0 for K3; ignored by "silu")
                scratch_bytes (int, default 0): size of the scratch output (TensorRT graphs)
                plugin_version (string, default "1"): TensorRT plugin version
    The others are required because TensorRT QDP attributes cannot have defaults (TensorRT graphs always
    carry scratch_bytes).

`register()` installs the schema with a Python type-and-shape inference function (see
`sparse_mla_attention/onnx_schema.py`), idempotently.
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import input_dim, plugin_lookup_attributes, register_once, tensor_type

OP_TYPE = "MoEMXFP4"


def _infer(ctx) -> None:
    elem = ctx.get_input_type(0).tensor_type.elem_type or onnx.TensorProto.FLOAT
    ctx.set_output_type(0, tensor_type(elem, [input_dim(ctx, 0, 0), input_dim(ctx, 0, 1)]))
    if ctx.get_num_outputs() > 1:  # TensorRT graphs: the workspace output, `scratch_bytes` int8
        size = helper.get_attribute_value(ctx.get_attribute("scratch_bytes"))
        ctx.set_output_type(1, tensor_type(onnx.TensorProto.INT8, [size]))


def schema() -> defs.OpSchema:
    """The OpSchema of MoEMXFP4 (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    attr = defs.OpSchema.Attribute
    kind = defs.OpSchema.AttrType
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Routed experts with MXFP4 weights (W4A16): this rank's weighted partial sum over the chosen experts.",
        inputs=[
            p("x", "T", "[T, D]"),
            p("expert_ids", "tensor(int64)", "[T, k] global expert ids"),
            p("expert_weights", "tensor(float)", "[T, k]"),
            p("w13_packed", "B", "[E, 2I, D/2]"),
            p("w13_scale", "B", "[E, 2I, D/32]"),
            p("w2_packed", "B", "[E, D, I/2]"),
            p("w2_scale", "B", "[E, D, I/32]"),
            p("row_counts", "tensor(int64)", "[S] rows of x with tokens, summed (TensorRT graphs)",
              param_option=defs.OpSchema.FormalParameterOption.Optional),
        ],
        outputs=[p("y", "T", "[T, D]"),
                 p("scratch", "tensor(int8)", "[scratch_bytes] workspace (TensorRT graphs; never read)",
                   param_option=defs.OpSchema.FormalParameterOption.Optional)],
        type_constraints=[("T", ["tensor(float)", "tensor(bfloat16)"], "activations: fp32, or bf16 (TensorRT)"),
                          ("B", ["tensor(uint8)", "tensor(int8)"], "MXFP4 bytes: uint8, or int8 views (TensorRT)")],
        attributes=[
            attr("expert_offset", kind.INT, "global id of local expert 0"),
            attr("activation", kind.STRING, '"situ" or "silu"'),
            attr("situ_beta", kind.FLOAT, "SiTU beta"),
            attr("situ_linear_beta", kind.FLOAT, "SiTU linear beta"),
            attr("scratch_bytes", helper.make_attribute("scratch_bytes", 0),
                 "bytes of the workspace output (TensorRT graphs; ONNX Runtime graphs have no such output)"),
            *plugin_lookup_attributes(),
        ],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the MoEMXFP4 schema (idempotent)."""
    register_once(schema())


def make_node(
    x: str,
    expert_ids: str,
    expert_weights: str,
    w13_packed: str,
    w13_scale: str,
    w2_packed: str,
    w2_scale: str,
    y: str,
    *,
    expert_offset: int,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    name: str | None = None,
) -> onnx.NodeProto:
    """A MoEMXFP4 node over the given value names."""
    if activation not in ("situ", "silu"):
        raise ValueError(f'activation must be "situ" or "silu", got {activation!r}')
    return helper.make_node(
        OP_TYPE,
        [x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale],
        [y],
        name=name,
        domain=DOMAIN,
        expert_offset=int(expert_offset),
        activation=activation,
        situ_beta=float(situ_beta),
        situ_linear_beta=float(situ_linear_beta),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )

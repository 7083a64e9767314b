"""ONNX schema of `SparseMLAAttention` (domain `moe_export.plugins.DOMAIN`, opset `OPSET_VERSION`).

Node contract (semantics in `reference.py`):

    o_lat = SparseMLAAttention(q_lat, kv_pool, kv_new, cu_seqlens, block_tables, positions[, topk_indices])
    inputs   q_lat        [T, H, Dc+Dr]   float   absorbed queries [q_nope @ W_kc | q_pe]
             kv_pool      [NB, BS, Dc+Dr] C       paged latent cache pool (earlier steps' rows), C = float, bf16, fp16,
                                                  or uint8 [NB, BS, Dc+Dr+1]: fp8 E4M3 rows + an E8M0 scale byte
             kv_new       [T, Dc+Dr]      float   this step's latent rows, rounded to C (the runtime writes them
                                                  to the pool after the step)
             cu_seqlens   [N+1]           int64   cumulative query tokens per sequence
             block_tables [N, B]          int64   each sequence's pool blocks in order (-1 = unused)
             positions    [T]             int64   absolute position of each query token
             topk_indices [T, K]         int64   optional: positions to attend, -1 = padding; empty name
                                                 (or K = 0 columns, the TensorRT form) = dense causal
    output   o_lat        [T, H, Dc]     float
    TensorRT form: kv_pool is the pool table [P, 3] int64 (`plugins/pool_table.py`; the pool is no graph input)
    and the attributes pool (its row), block_size and pool_dtype (fp32 / bf16 / fp8) describe the pool.
    attributes  scale (float, required): softmax scale, (qk_nope + qk_rope)^-0.5 = 192^-0.5 for K3
                kv_lora_rank (int, required): Dc, the width of the value part of each cache row
                plugin_version (string, default "1"): TensorRT plugin version

`register()` adds the schema to onnx's registry with a Python type-and-shape inference function
(`OpSchema.set_type_and_shape_inference_function`, available in onnx 1.23), so `onnx.checker.check_model(...,
full_check=True)` and `onnx.shape_inference.infer_shapes(..., strict_mode=True)` accept graphs with the node.
It is idempotent (the registry is process-global). The helpers below are shared by the other ops' schemas.
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION

OP_TYPE = "SparseMLAAttention"
CACHE_TYPE_CONSTRAINT = ("C", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)", "tensor(uint8)", "tensor(int64)"],
                         "cache storage dtype; uint8 = fp8 rows [.., D + 1] (moe_export.quantize.fp8_cache); int64: "
                         "the pool table (TensorRT graphs)")


def register_once(schema: defs.OpSchema) -> None:
    """Register `schema` unless an op of that name already exists in its domain."""
    if not defs.has(schema.name, schema.domain):
        defs.register_schema(schema)


def plugin_lookup_attributes() -> list[defs.OpSchema.Attribute]:
    """The optional string attributes TensorRT's ONNX parser finds a plugin by (its name is the op type), which
    every plugin node carries: `plugin_version` (default PLUGIN_VERSION) and `plugin_namespace` (default
    PLUGIN_NAMESPACE; parsers before TensorRT 10.13 do not take the namespace from the node's domain)."""
    return [
        defs.OpSchema.Attribute(
            "plugin_version", helper.make_attribute("plugin_version", PLUGIN_VERSION), "TensorRT plugin version"
        ),
        defs.OpSchema.Attribute(
            "plugin_namespace", helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE), "TensorRT namespace"
        ),
    ]


POOL_TABLE_DOC = ("or, in TensorRT graphs, the pool table [P, 3] int64 (plugins/pool_table.py) with attribute `pool` "
                  "naming the pool's row: the pool itself is then no graph input")


def pool_table_attributes(paged: bool) -> list[defs.OpSchema.Attribute]:
    """The attributes of a pool op's TensorRT form (the pool input is the pool table): `pool`, the table row
    (default -1: the input is the pool itself); for paged caches also `block_size` and `pool_dtype` (the recipe's
    kv_cache: fp32, bf16 or fp8), which the pool tensor's shape and type gave before."""
    attrs = [defs.OpSchema.Attribute("pool", helper.make_attribute("pool", -1), "pool table row (-1: pool input)")]
    if paged:
        attrs += [defs.OpSchema.Attribute("block_size", helper.make_attribute("block_size", 0), "positions per block"),
                  defs.OpSchema.Attribute("pool_dtype", helper.make_attribute("pool_dtype", ""), "fp32, bf16 or fp8")]
    return attrs


def paged_cache_inputs() -> list[defs.OpSchema.FormalParameter]:
    """The formal inputs every op reading or writing a paged cache takes after its own: cu_seqlens [N+1],
    block_tables [N, B], positions [T] (int64; layout in `reference.py`)."""
    p = defs.OpSchema.FormalParameter
    return [p("cu_seqlens", "tensor(int64)", "[N+1]"), p("block_tables", "tensor(int64)", "[N, B]"),
            p("positions", "tensor(int64)", "[T]")]


def input_dim(ctx, index: int, axis: int) -> onnx.TensorShapeProto.Dimension:
    """Dimension `axis` of input `index` as a TensorShapeProto.Dimension (empty if unknown)."""
    dim = onnx.TensorShapeProto.Dimension()
    ttype = ctx.get_input_type(index)
    if ttype is not None and ttype.tensor_type.HasField("shape"):
        dims = ttype.tensor_type.shape.dim
        if axis < len(dims):
            dim.CopyFrom(dims[axis])
    return dim


def tensor_type(elem_type: int, dims: list) -> onnx.TypeProto:
    """TypeProto of a tensor with `dims` entries each a TensorShapeProto.Dimension or int."""
    ttype = onnx.TypeProto()
    ttype.tensor_type.elem_type = elem_type
    shape = ttype.tensor_type.shape
    for d in dims:
        new = shape.dim.add()
        if isinstance(d, int):
            new.dim_value = d
        else:
            new.CopyFrom(d)
    return ttype


def _infer(ctx) -> None:
    rank = helper.get_attribute_value(ctx.get_attribute("kv_lora_rank"))
    out = tensor_type(onnx.TensorProto.FLOAT, [input_dim(ctx, 0, 0), input_dim(ctx, 0, 1), int(rank)])
    ctx.set_output_type(0, out)


def schema() -> defs.OpSchema:
    """The OpSchema of SparseMLAAttention (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    opt = defs.OpSchema.FormalParameterOption.Optional
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Absorbed MLA over a paged latent cache restricted to top-k positions (dense causal without indices).",
        inputs=[
            p("q_lat", "tensor(float)", "[T, H, Dc+Dr]"),
            p("kv_pool", "C", "[NB, BS, Dc+Dr], " + POOL_TABLE_DOC),
            p("kv_new", "tensor(float)", "[T, Dc+Dr]"),
            *paged_cache_inputs(),
            p("topk_indices", "tensor(int64)", "[T, K], -1 = padding", param_option=opt),
        ],
        outputs=[p("o_lat", "tensor(float)", "[T, H, Dc]")],
        type_constraints=[CACHE_TYPE_CONSTRAINT],
        attributes=[
            defs.OpSchema.Attribute("scale", defs.OpSchema.AttrType.FLOAT, "softmax scale"),
            defs.OpSchema.Attribute("kv_lora_rank", defs.OpSchema.AttrType.INT, "Dc"),
            *pool_table_attributes(paged=True),
            *plugin_lookup_attributes(),
        ],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the SparseMLAAttention schema (idempotent)."""
    register_once(schema())


def make_node(
    q_lat: str,
    kv_pool: str,
    kv_new: str,
    cu_seqlens: str,
    block_tables: str,
    positions: str,
    topk_indices: str | None,
    o_lat: str,
    *,
    scale: float,
    kv_lora_rank: int,
    name: str | None = None,
) -> onnx.NodeProto:
    """A SparseMLAAttention node over the given value names; `topk_indices=None` makes it dense causal."""
    inputs = [q_lat, kv_pool, kv_new, cu_seqlens, block_tables, positions]
    if topk_indices:
        inputs.append(topk_indices)
    return helper.make_node(
        OP_TYPE,
        inputs,
        [o_lat],
        name=name,
        domain=DOMAIN,
        scale=float(scale),
        kv_lora_rank=int(kv_lora_rank),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )

"""ONNX schema of `DSAIndexer` (domain `moe_export.plugins.DOMAIN`, opset `OPSET_VERSION`).

Node contract (semantics in `reference.py`):

    indices = DSAIndexer(q_idx, weights, k_pool, k_new, cu_seqlens, block_tables, positions)
    inputs   q_idx        [T, Hi, Di]   float   indexer queries (after wq_b and rope)
             weights      [T, Hi]       float   head weights, already scaled by Hi^-0.5 * Di^-0.5
             k_pool       [NB, BS, Di]  C       paged indexer key pool (earlier steps), C = float, bf16, fp16, or
                                            uint8 [NB, BS, Di+1]: fp8 E4M3 rows + an E8M0 scale byte
             k_new        [T, Di]       float   this step's keys (after wk, k_norm, rope), rounded to C
             cu_seqlens   [N+1]         int64   cumulative query tokens per sequence
             block_tables [N, B]        int64   each sequence's pool blocks in order (-1 = unused)
             positions    [T]           int64   absolute position of each query token
    output   indices     [T, topk]    int64   positions in the sequence, best first, -1 padding
    attributes  topk (int, required): number of positions selected per token (index_topk, 2048 for DSA)
                plugin_version (string, default "1"): TensorRT plugin version

`register()` installs the schema with a Python type-and-shape inference function (see
`sparse_mla_attention/onnx_schema.py`), idempotently.
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import (
    CACHE_TYPE_CONSTRAINT,
    input_dim,
    paged_cache_inputs,
    POOL_TABLE_DOC,
    plugin_lookup_attributes,
    pool_table_attributes,
    register_once,
    tensor_type,
)

OP_TYPE = "DSAIndexer"


def _infer(ctx) -> None:
    topk = helper.get_attribute_value(ctx.get_attribute("topk"))
    ctx.set_output_type(0, tensor_type(onnx.TensorProto.INT64, [input_dim(ctx, 0, 0), int(topk)]))
    if ctx.get_num_outputs() > 1:  # TensorRT graphs: the workspace output, `scratch_bytes` int8
        size = helper.get_attribute_value(ctx.get_attribute("scratch_bytes"))
        ctx.set_output_type(1, tensor_type(onnx.TensorProto.INT8, [size]))


def schema() -> defs.OpSchema:
    """The OpSchema of DSAIndexer (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "DeepSeek-V3.2 lightning indexer: causal relu-scored, head-weighted top-k positions per query token.",
        inputs=[
            p("q_idx", "tensor(float)", "[T, Hi, Di]"),
            p("weights", "tensor(float)", "[T, Hi]"),
            p("k_pool", "C", "[NB, BS, Di], " + POOL_TABLE_DOC),
            p("k_new", "tensor(float)", "[T, Di]"),
            *paged_cache_inputs(),
        ],
        outputs=[p("indices", "tensor(int64)", "[T, topk]"),
                 p("scratch", "tensor(int8)", "[scratch_bytes] workspace (TensorRT graphs; never read)",
                   param_option=defs.OpSchema.FormalParameterOption.Optional)],
        type_constraints=[CACHE_TYPE_CONSTRAINT],
        attributes=[
            defs.OpSchema.Attribute("topk", defs.OpSchema.AttrType.INT, "positions selected per token"),
            defs.OpSchema.Attribute("scratch_bytes", helper.make_attribute("scratch_bytes", 0),
                                    "bytes of the workspace output (TensorRT graphs only)"),
            *pool_table_attributes(paged=True),
            *plugin_lookup_attributes(),
        ],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the DSAIndexer schema (idempotent)."""
    register_once(schema())


def make_node(
    q_idx: str,
    weights: str,
    k_pool: str,
    k_new: str,
    cu_seqlens: str,
    block_tables: str,
    positions: str,
    indices: str,
    *,
    topk: int,
    name: str | None = None,
) -> onnx.NodeProto:
    """A DSAIndexer node over the given value names."""
    return helper.make_node(
        OP_TYPE,
        [q_idx, weights, k_pool, k_new, cu_seqlens, block_tables, positions],
        [indices],
        name=name,
        domain=DOMAIN,
        topk=int(topk),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )

"""ONNX schema of `PagedCacheWrite` (domain `moe_export.plugins.DOMAIN`, opset `OPSET_VERSION`).

Node contract (semantics in `reference.py`):

    pool_out = PagedCacheWrite(pool, new_rows, cu_seqlens, block_tables, positions)
    inputs   pool         [NB, BS, W]  C      paged cache pool (MLA latents or indexer keys), C = float, bf16,
                                              fp16, or uint8 [NB, BS, D + 1]: fp8 E4M3 rows + an E8M0 scale byte
             new_rows     [T, D]       float  this step's rows, already rounded to C
             cu_seqlens   [N+1]        int64  cumulative tokens per sequence
             block_tables [N, B]       int64  each sequence's pool blocks in order (-1 = unused)
             positions    [T]          int64  absolute position of each token
    output   pool_out     [NB, BS, W]  C      the pool with the rows written; on TensorRT the same buffer as
                                              `pool` (aliased output: an in-place write, O(T))
    attributes  plugin_version, plugin_namespace (TensorRT plugin lookup)

Only TensorRT graphs hold the node (`graphs/onnx_export.py`, backend tensorrt). ONNX Runtime cannot alias an
output to an input, so its graphs return the new rows and the runtime stores them (`cpu.paged_cache_write_`);
there is no ORT function body, which would have to copy the whole pool.
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import (
    CACHE_TYPE_CONSTRAINT,
    paged_cache_inputs,
    plugin_lookup_attributes,
    register_once,
)

OP_TYPE = "PagedCacheWrite"


def _infer(ctx) -> None:
    pool = ctx.get_input_type(0)
    if pool is not None:
        ctx.set_output_type(0, pool)


def schema() -> defs.OpSchema:
    """The OpSchema of PagedCacheWrite (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Stores a step's new cache rows into a paged pool at each token's block-table row (in place on TensorRT).",
        inputs=[
            p("pool", "C", "[NB, BS, W]"),
            p("new_rows", "tensor(float)", "[T, D]"),
            *paged_cache_inputs(),
        ],
        outputs=[p("pool_out", "C", "[NB, BS, W], aliases pool on TensorRT")],
        type_constraints=[CACHE_TYPE_CONSTRAINT],
        attributes=plugin_lookup_attributes(),
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the PagedCacheWrite schema (idempotent)."""
    register_once(schema())


def make_node(pool: str, new_rows: str, cu_seqlens: str, block_tables: str, positions: str, pool_out: str,
              name: str | None = None) -> onnx.NodeProto:  # fmt: skip
    """A PagedCacheWrite node over the given value names."""
    return helper.make_node(OP_TYPE, [pool, new_rows, cu_seqlens, block_tables, positions], [pool_out], name=name,
                            domain=DOMAIN, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE)

"""ONNX schema of `PagedCacheWrite` (domain `moe_export.plugins.DOMAIN`, opset `OPSET_VERSION`).

Node contract (semantics in `reference.py`):

    rows_out = PagedCacheWrite(pool_table, new_rows, cu_seqlens, block_tables, positions)
    inputs   pool_table   [P, 3]       int64  the pool table (`plugins/pool_table.py`): the pool is row `pool`, a
                                              [NB, BS, W] pool of `pool_dtype` (fp32, bf16, or fp8: uint8
                                              [NB, BS, D + 1], E4M3 rows + an E8M0 scale byte)
             new_rows     [T, D]       float  this step's rows, already rounded to the pool's storage
             cu_seqlens   [N+1]        int64  cumulative tokens per sequence
             block_tables [N, B]       int64  each sequence's pool blocks in order (-1 = unused)
             positions    [T]          int64  absolute position of each token
    output   rows_out     [T, D]       float  new_rows, once they are in the pool: the pool's readers in the
                                              step take their new rows from this output, so TensorRT orders them
                                              after the write (the pool itself is no tensor of the graph)
    attributes  pool (int), block_size (int), pool_dtype (string); plugin_version, plugin_namespace

Only TensorRT graphs hold the node (`graphs/onnx_export.py`, backend tensorrt). ONNX Runtime graphs take the
pools as inputs and return the new rows, which the runtime stores (`cpu.paged_cache_write_`).
"""

import onnx
from onnx import defs, helper

from .. import DOMAIN, OPSET_VERSION, PLUGIN_NAMESPACE, PLUGIN_VERSION
from ..sparse_mla_attention.onnx_schema import paged_cache_inputs, plugin_lookup_attributes, register_once

OP_TYPE = "PagedCacheWrite"


def _infer(ctx) -> None:
    rows = ctx.get_input_type(1)
    if rows is not None:
        ctx.set_output_type(0, rows)


def schema() -> defs.OpSchema:
    """The OpSchema of PagedCacheWrite (not yet registered)."""
    p = defs.OpSchema.FormalParameter
    s = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        "Stores a step's new cache rows into a paged pool, reached through the pool table, at each token's "
        "block-table row; passes the rows on.",
        inputs=[
            p("pool_table", "tensor(int64)", "[P, 3]"),
            p("new_rows", "tensor(float)", "[T, D]"),
            *paged_cache_inputs(),
        ],
        outputs=[p("rows_out", "tensor(float)", "[T, D]")],
        attributes=[defs.OpSchema.Attribute("pool", defs.OpSchema.AttrType.INT, "pool table row"),
                    defs.OpSchema.Attribute("block_size", defs.OpSchema.AttrType.INT, "positions per block"),
                    defs.OpSchema.Attribute("pool_dtype", defs.OpSchema.AttrType.STRING, "fp32, bf16 or fp8"),
                    *plugin_lookup_attributes()],
    )
    s.set_type_and_shape_inference_function(_infer)
    return s


def register() -> None:
    """Register the PagedCacheWrite schema (idempotent)."""
    register_once(schema())


def make_node(pool_table: str, new_rows: str, cu_seqlens: str, block_tables: str, positions: str, rows_out: str, *,
              pool: int, block_size: int, pool_dtype: str, name: str | None = None) -> onnx.NodeProto:  # fmt: skip
    """A PagedCacheWrite node over the given value names."""
    return helper.make_node(OP_TYPE, [pool_table, new_rows, cu_seqlens, block_tables, positions], [rows_out],
                            name=name, domain=DOMAIN, pool=int(pool), block_size=int(block_size),
                            pool_dtype=pool_dtype, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE)

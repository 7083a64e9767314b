"""TensorRT's rank graph form: the state pools stay in place. No pool is a graph input or output (TensorRT "may
insert copies" for aliased plugin I/O): one input `pool_table` [P, 3] int64 holds every pool's device address
(`plugins/pool_table.py`; the runner owns the pools), the pool ops name their row with the attribute `pool` (paged
caches also `block_size`, `pool_dtype`), GatedDeltaScan / ShortConv update their slots in place, and a
`PagedCacheWrite` per cache pool stores the step's rows, whose output (the rows passed on) feeds that pool's readers
so that TensorRT orders them after the write. The pools, in table row order, are the model's metadata `pools`.
Shapes are static where TensorRT needs them: MoE receive buffers bounded by the recipe's limits, plugin scratch a
plugin output sized from the limits (in the engine's device memory)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from moe_export.graphs.onnx_form import POOL_TABLE, POOLS_KEY, PoolsAsGraphIO
from moe_export.plugins.dsa_indexer.sizes import workspace_bytes as indexer_workspace_bytes
from moe_export.plugins.moe_mxfp4.sizes import workspace_bytes as moe_workspace_bytes
from onnx import TensorProto


@dataclass(frozen=True)
class PoolsInPlace(PoolsAsGraphIO):
    """The pool lowering of TensorRT graphs (see the module docstring); same methods as `PoolsAsGraphIO`."""

    # int8 views of the MXFP4 bytes: TensorRT's ONNX parser would widen uint8 initializers to int32
    # (plugins/tensorrt_contracts.py: PARSER_UINT8_WEIGHTS_BECOME_INT32)
    mxfp4_type = TensorProto.INT8

    def pool(self, rg, name: str, elem: int, dims: list):
        """A row of the pool table (its index), listed in the graph's metadata for the runner."""
        rg.pools.append((name, elem, dims))
        return len(rg.pools) - 1

    def slot_op(self, rg, op: str, inputs: list[str], io: dict, pool: str, out_key: str, gathered: str, name: str,
                **attrs) -> str:
        """The op updates its sequences' slots of the pool in place, through the pool table."""
        return rg.g.plugin(op, [*inputs, POOL_TABLE, io["cu"], io["slots"]], name, pool=io[pool], **attrs)

    def cache_rows(self, rg, rows: str, io: dict, pool: str, out_key: str, name: str) -> str:
        """PagedCacheWrite of the step's rounded rows into the pool; returns the rows as the node passes them on (the
        pool's readers take them from there, so they run after the write)."""
        return rg.g.plugin("PagedCacheWrite", [POOL_TABLE, rows, io["cu"], io["tables"], io["positions"]], name,
                           **self.pool_attributes(rg, io[pool]))

    def paged_pool(self, io: dict, pool: str) -> str:
        return POOL_TABLE

    def pool_attributes(self, rg, pool) -> dict:
        """The pool's table row, block size and storage."""
        return dict(pool=pool, block_size=int(rg.limits.block_size), pool_dtype=rg.kv_cache)

    def indexer(self, rg, inputs: list[str], io: dict, pool: str, name: str) -> str:
        """The chunk buffers are the plugin's second output, in the engine's device memory."""
        limits = rg.limits
        length = -(-limits.max_seq_len // limits.block_size) * limits.block_size  # the tables' capacity
        size = indexer_workspace_bytes(limits.max_num_tokens, length, int(rg.topk))
        return rg.g.plugin("DSAIndexer", inputs, name, 2, topk=int(rg.topk), scratch_bytes=size,
                           **self.pool_attributes(rg, io[pool]))[0]

    def dispatch_attributes(self, rg) -> dict:
        """Static shapes: receive buffers bounded by the recipe's limits."""
        m = rg.m
        return dict(group_size=m.ep, max_recv_rows=m.max_recv_rows(rg.limits.max_num_tokens))

    def experts_inputs(self, rg, z: str, act_in: str, experts: list[str], received: str | None) -> tuple[str, dict]:
        """Activations in and out as they are, the rows with tokens counted on the device (after a dispatch: the
        rows received; else one count covering every row) as one more input, and the plugin's scratch as its
        second output."""
        cfg, m, limits = rg.cfg, rg.m, rg.limits
        experts.append(received if received is not None
                       else rg.g.const([limits.max_num_tokens], hint="moe_all_rows"))
        local = len(m.local_experts(cfg.num_experts))
        expert_rows = m.max_recv_rows(limits.max_num_tokens) if received is not None else limits.max_num_tokens
        return z, dict(n_out=2, scratch_bytes=moe_workspace_bytes(expert_rows, cfg.num_experts_per_token,
                                                                  cfg.expert_in_dim, cfg.moe_intermediate_size, local))

    def finish(self, rg) -> list[tuple[str, str]]:
        """The pool table input (when the graph has pools) and the pools as metadata."""
        if rg.pools:
            rg._input(POOL_TABLE, TensorProto.INT64, [len(rg.pools), 3])
        return [(POOLS_KEY, json.dumps([{"name": n, "elem_type": e, "dims": d} for n, e, d in rg.pools]))]

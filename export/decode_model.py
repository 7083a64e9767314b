"""The dp layout's MoE cost per decode step as the code runs it, readable before a GPU exists (`moe-export plan`).

Per MoE layer and rank (the TensorRT graph, `graphs/onnx_moe.py` `FeedForwardLayers.moe`):
  - MoEDispatch (`plugins/collectives/all_to_all.py` `torch_dispatch_into`): the counts all-to-all, ONE READ-BACK
    of the counts to the host (NCCL's all-to-all-v takes host split sizes), three all-to-all-v of the counted
    rows; then -1 / 0 written into the ids and weights past the rows received, up to the static bound R;
  - the graph's Cast of the receive buffer [R, D] bf16 -> fp32 (the expert op's input);
  - MoEMXFP4 (`plugins/moe_mxfp4/triton_kernel.py` `moe_mxfp4_triton`) over all R rows in chunks of
    `chunk_tokens` rows: per chunk the pair layout (one program), the up and down kernels (grids from the chunk's
    pair capacity and `tile_config`) writing fp32 partial sums [rows x k, D], and the combine kernel reading them
    into y [rows, D];
  - the graph's Cast of y [R, D] fp32 -> bf16, and MoECombine's all-to-all-v of the counted rows back.
R = `Mapping.max_recv_rows(max_num_tokens)` whatever the step's batch, so these bytes and launches are paid at
every decode step. Launches count the kernels, passes, Casts, fills and NCCL calls named (at least: the chunk's
pair-layout ops are more). The expert weights read (every local expert a token was routed to) are the same for a
counted-rows op and are given apart. Bytes are device-memory traffic (written + read) of the passes named.
`counted_moe_op` is the same expert op in its counted-rows mode (`recv_counts`, `row_bound`): valid rows read on
the device, chunks and grids bounded by the step's row bound, not by R.
"""

from __future__ import annotations

from moe_export.plugins.moe_mxfp4 import sizes as moe

EXPERT_BITS_PER_WEIGHT = 4.25  # MXFP4
NCCL_CALLS_PER_LAYER = 5  # dispatch: counts, rows, ids, weights; combine: rows


def _expert_op_launches(rows: int, top_k: int, dim: int, inter: int, num_local: int, budget_bytes: int,
                        counted: bool) -> tuple[int, int]:  # fmt: skip
    """(kernel launches, programs as launched) of `moe_mxfp4_triton` over `rows` rows in chunks, with static grids
    or (counted) the bounded grids of `recv_counts` mode (`sizes.block_programs`, `sizes.combine_programs`)."""
    step = moe.chunk_tokens(top_k, dim, inter, budget_bytes)
    launches = programs = 0
    for t0 in range(0, rows, step):
        n = min(step, rows - t0)
        tiles = moe.tile_config(n * top_k, num_local, dim, inter)
        bm, bn = tiles["block_m"], tiles["block_n"]
        if moe.pair_capacity(n * top_k, num_local, bm):
            launches += 3  # pair layout, up, down
            programs += 1 + moe.block_programs(n * top_k, num_local, bm, counted) * (-(-inter // bn) + -(-dim // bn))
        launches += 1  # combine
        programs += moe.combine_programs(n, dim, counted) * -(-dim // moe.COMBINE_BLOCK_D)
    return launches, programs


def full_buffer_moe_op(rows: int, top_k: int, dim: int, inter: int, num_local: int,
                       budget_bytes: int = moe.DEFAULT_SCRATCH_BUDGET) -> dict[str, int]:  # fmt: skip
    """What `moe_mxfp4_triton` does over `rows` received rows: chunks, kernel launches and their programs, and the
    bytes of the fp32 partial sums its down kernel writes and its combine reads (a pass over the whole buffer)."""
    launches, programs = _expert_op_launches(rows, top_k, dim, inter, num_local, budget_bytes, counted=False)
    return {
        "chunks": -(-rows // moe.chunk_tokens(top_k, dim, inter, budget_bytes)),
        "kernel_launches": launches,
        "kernel_programs": programs,
        "full_buffer_passes": 1,  # the partial sums: written by the down kernel, read by the combine
        "partial_sum_bytes": 2 * rows * top_k * dim * 4,
        "output_bytes": rows * dim * 4,
    }


def counted_moe_op(row_bound: int, top_k: int, dim: int, inter: int, num_local: int,
                   budget_bytes: int = moe.DEFAULT_SCRATCH_BUDGET) -> dict[str, int]:  # fmt: skip
    """What `moe_mxfp4_triton(recv_counts=..., row_bound=row_bound)` does whatever the receive buffer's rows: the
    chunks of [0, row_bound), launches and programs of its bounded grids, no pass over the buffer, and at most the
    bytes of the rows bound: fp32 partial sums of their pairs (written and read), their bf16 output."""
    launches, programs = _expert_op_launches(row_bound, top_k, dim, inter, num_local, budget_bytes, counted=True)
    return {
        "chunks": -(-row_bound // moe.chunk_tokens(top_k, dim, inter, budget_bytes)),
        "kernel_launches": launches,
        "kernel_programs": programs,
        "full_buffer_passes": 0,
        "partial_sum_bytes": 2 * row_bound * top_k * dim * 4,
        "output_bytes": row_bound * dim * 2,
    }


def dp_decode_step(cfg, recipe, mapping) -> dict:
    """The dp layout's decode step on a rank of `mapping` at max_batch tokens per attention group: per MoE layer
    and per step, host syncs, launches, bytes (see the module docstring), and the rows that carry tokens."""
    limits = recipe.limits
    rows = mapping.max_recv_rows(limits.max_num_tokens)
    k, dim, inter = cfg.num_experts_per_token, cfg.expert_in_dim, cfg.moe_intermediate_size
    local = len(mapping.local_experts(cfg.num_experts))
    op = full_buffer_moe_op(rows, k, dim, inter, local)
    groups = mapping.world_size // mapping.tp
    counted_rows = min(rows, -(-limits.max_batch * groups * min(k, mapping.ep) // mapping.ep))
    casts = rows * dim * (2 + 4) * 2  # [R, D] bf16 -> fp32 in, fp32 -> bf16 out (read + write each)
    tails = rows * k * (8 + 4)  # ids (int64) and weights (fp32) set past the rows received, at most R rows
    layer = {
        "receive_rows": rows,
        "rows_with_tokens": counted_rows,
        "host_syncs": 1,
        "launches_at_least": op["kernel_launches"] + 2 + 2 + NCCL_CALLS_PER_LAYER,
        "kernel_programs": op["kernel_programs"],
        "full_buffer_passes": op["full_buffer_passes"] + 2 + 2,  # + the two Casts and the two tail fills
        "full_buffer_bytes": op["partial_sum_bytes"] + op["output_bytes"] + casts + tails,
        "counted_rows_bytes": counted_rows * (dim * 2 * 2 + k * 12),  # bf16 rows in and out, ids and weights
        "expert_weight_bytes": int(min(local, counted_rows * k) * 3 * dim * inter * EXPERT_BITS_PER_WEIGHT / 8),
        "expert_op": op,
    }
    layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    step = {key: layer[key] * layers for key in ("host_syncs", "launches_at_least", "full_buffer_passes",
                                                   "full_buffer_bytes", "counted_rows_bytes", "expert_weight_bytes")}
    step["host_syncs"] += 1  # the logits (or sampled ids) the host waits for
    return {"moe_layers": layers, "tokens_per_group": limits.max_batch, "per_layer": layer, "per_step": step}

"""The dp layout's MoE cost per decode step as the code runs it, readable before a GPU exists (`moe-export plan`).

A dp decode step replays the CUDA graph of the world's decode bucket (`runtime/engine/tensorrt.py`: every rank
runs the largest bucket among the world's decode steps, max_batch at most); per MoE layer and rank (the
TensorRT graph, `graphs/onnx_moe.py` `FeedForwardLayers.moe`):
  - MoEDispatch (`plugins/collectives/all_to_all.py` `torch_dispatch_into`, block transport): the routing on the
    device, the counts all-to-all and one all-to-all of blocks of B = ceil(bucket / tp) packed rows per peer,
    the received blocks compacted to the head of the static receive buffer; no host value; three Triton kernels
    (`plugins/collectives/transport_kernels.py`: route, pack, unpack);
  - MoEMXFP4 (`plugins/moe_mxfp4/triton_kernel.py` `moe_mxfp4_triton`, counted rows): bf16 in and out, the rows
    received read from the dispatch's counts on the device, chunks and grids bounded by the host's bound ep x B
    (`counted_moe_op`), never by the static bound R;
  - MoECombine: the partial sums back in blocks, each token's rows summed over its choices (two Triton kernels:
    expand, sum).
R = `Mapping.max_recv_rows(max_num_tokens)` is memory only. The transport's Triton kernel launches, its other
device ops (aten ops that launch work, views excluded; none now) and its collectives (`TRANSPORT_OPS`, counted by
`benchmarks/gpu_dp_step_check.py`: the kernels by a pass-through wrapper, the rest with a TorchDispatchMode) are
constants of the code; launches are at most their sum. Wire bytes are what the rank sends other ranks (its own
block stays). An eager step (prefill, mixed) instead takes the counted
transport: one read-back of the counts per MoE layer. `full_buffer_moe_op` is the expert op over the whole
static buffer (the dp layout before counted rows), the baseline `benchmarks/gpu_trt_check.py` times.
"""

from __future__ import annotations

from moe_export.plugins.collectives.all_to_all import packed_row_bytes
from moe_export.plugins.moe_mxfp4 import sizes as moe

EXPERT_BITS_PER_WEIGHT = 4.25  # MXFP4
ACT_BYTES = 2  # bf16 activations
# the block transport's device ops and collectives per MoE layer (checked against the code by
# tests/test_dp_decode_model.py through benchmarks/gpu_dp_step_check.py's dry run)
TRANSPORT_OPS = {"dispatch_kernels": 3, "dispatch_ops": 0, "dispatch_collectives": 2,
                 "combine_kernels": 2, "combine_ops": 0, "combine_collectives": 1}


def _expert_op_launches(rows: int, top_k: int, dim: int, inter: int, num_local: int, budget_bytes: int,
                        counted: bool) -> tuple[int, int]:  # fmt: skip
    """(kernel launches, programs as launched) of `moe_mxfp4_triton` over `rows` rows in chunks, with static grids
    or (counted) the bounded grids of `recv_counts` mode (`sizes.block_programs`, `sizes.combine_programs`)."""
    step = moe.chunk_tokens(top_k, dim, inter, budget_bytes)
    launches = programs = 0
    for t0 in range(0, rows, step):
        n = min(step, rows - t0)
        tiles = moe.tile_config(n * top_k, num_local, dim, inter)
        bm, bn, split_up = tiles["block_m"], tiles["block_n"], tiles["split_up"]
        cap = moe.pair_capacity(n * top_k, num_local, bm)
        if cap:
            launches += 3 + (split_up > 1)  # pair layout, up, (the activation after a split up), down
            grid_m = moe.block_programs(n * top_k, num_local, bm, counted)
            programs += 1 + grid_m * (-(-inter // bn) * split_up + -(-dim // bn) * tiles["split_down"])
            if split_up > 1:
                programs += min(cap, 2 * moe.H200_SMS) * -(-inter // moe.ACT_BLOCK_I)
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
    """The dp layout's decode step on a rank of `mapping` at the largest decode bucket (max_batch tokens per
    attention group): per MoE layer and per step, host syncs, launches, bytes (see the module docstring), and the
    rows that carry tokens."""
    limits = recipe.limits
    rows = mapping.max_recv_rows(limits.max_num_tokens)
    k, dim, inter = cfg.num_experts_per_token, cfg.expert_in_dim, cfg.moe_intermediate_size
    local = len(mapping.local_experts(cfg.num_experts))
    block = -(-limits.max_batch // mapping.tp)
    bound = min(rows, mapping.ep * block)
    op = counted_moe_op(bound, k, dim, inter, local)
    groups = mapping.world_size // mapping.tp
    counted_rows = min(bound, -(-limits.max_batch * groups * min(k, mapping.ep) // mapping.ep))
    peers = mapping.ep - 1
    ops = sum(TRANSPORT_OPS[f"{side}_{kind}"] for side in ("dispatch", "combine") for kind in ("kernels", "ops"))
    collectives = TRANSPORT_OPS["dispatch_collectives"] + TRANSPORT_OPS["combine_collectives"]
    layer = {
        "receive_rows": rows,
        "block_rows": block,
        "rows_bound": bound,
        "rows_with_tokens": counted_rows,
        "host_syncs": 0,
        "nccl_calls": collectives,
        "launches_at_most": op["kernel_launches"] + ops + collectives,
        "kernel_programs": op["kernel_programs"],
        "full_buffer_passes": op["full_buffer_passes"],
        "wire_bytes": peers * (8 + block * packed_row_bytes(dim, ACT_BYTES, k) + block * dim * ACT_BYTES),
        "counted_rows_bytes": counted_rows * (dim * ACT_BYTES * 2 + k * 12),  # rows in and out, ids and weights
        "expert_weight_bytes": int(min(local, counted_rows * k) * 3 * dim * inter * EXPERT_BITS_PER_WEIGHT / 8),
        "expert_op": op,
    }
    layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    step = {key: layer[key] * layers for key in ("host_syncs", "nccl_calls", "launches_at_most", "full_buffer_passes",
                                                   "wire_bytes", "counted_rows_bytes", "expert_weight_bytes")}
    step["host_syncs"] += 1  # the step's one wait: the logits (or sampled ids) and the expert counts
    step["host_all_reduces"] = 1  # the world's bucket agreement over MPI (host values, no device wait)
    return {"moe_layers": layers, "tokens_per_group": limits.max_batch, "per_layer": layer, "per_step": step,
            "eager_step_host_syncs": layers + 1}  # fmt: skip

"""GPU measurements the TensorRT planner and the dp decode-step model stand on (one H200, < 2 minutes), as JSON.

  - `usable_gpu_bytes`: what CUDA reports as the device's total (torch.cuda.mem_get_info) and what is free once
    a context exists, next to the planner's NVML figure (`export/plan/memory.py` EXPOSED_GPU_BYTES);
  - `dp_moe_full_buffer_ms`: the MoE expert op over the whole static receive buffer (`moe_mxfp4_triton`, bf16 in
    and out as the dp graph hands it the rows, K3's shapes: 65,536 rows x 3,584, top-16, 14 local experts of
    3,072), at a decode step whose rows with tokens are `rows_with_tokens`, with the decode-step model's bytes for
    it (`export/plan/decode_model.py`: its fp32 partial sums, the bf16 output) and the bandwidth they imply;
  - `dp_moe_counted_ms`: the same op, inputs and weights in its counted-rows mode (`recv_counts` of 64 ranks
    making the `rows_with_tokens` head rows valid, `row_bound` 192, bf16 in and out; `counted_model`), timed in
    the same rounds, alternated with the full-buffer run; `dp_moe_counted_speedup` = full / counted, and
    `dp_moe_counted_max_rel_diff`, its valid rows against the full-buffer run's (bf16 roundings only);
    `dp_moe_counted_decode_tiles_ms`: the counted op with the tiles `tile_config` picks for the rows with tokens
    (decode tiles) instead of for the row bound's pairs (its default), to choose between them;
    `dp_moe_counted_graph_replay_equal`: the counted op captured in a CUDA graph with no host wait, replayed at
    other receive counts, equals its eager run.
Run from the repo root: `python3 benchmarks/gpu_trt_check.py --json $OUT/gpu_trt_check.json`;
`--device cpu` (TRITON_INTERPRET=1) runs the same code at tiny shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]
from moe_export.export.plan.decode_model import counted_moe_op, full_buffer_moe_op
from moe_export.export.plan.memory import EXPOSED_GPU_BYTES
from moe_export.plugins.moe_mxfp4.sizes import tile_config, workspace_bytes
from moe_export.plugins.moe_mxfp4.triton_kernel import moe_mxfp4_triton

K3_SHAPES = {"rows": 65536, "top_k": 16, "dim": 3584, "inter": 3072, "num_local": 14, "rows_with_tokens": 48,
             "recv_ranks": 64, "row_bound": 192}  # fmt: skip
TINY_SHAPES = {"rows": 64, "top_k": 2, "dim": 64, "inter": 32, "num_local": 2, "rows_with_tokens": 3, "recv_ranks": 4,
               "row_bound": 8}  # fmt: skip
COUNTED_CALLS_PER_ROUND = 10  # the counted op is short: several calls per timed round


def usable_memory(device: torch.device) -> dict:
    """CUDA's total and free bytes with a context, and the planner's exposed bytes for an H200."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"usable_gpu_bytes": int(total), "free_after_context_bytes": int(free),
            "planner_exposed_bytes": EXPOSED_GPU_BYTES["h200"]}  # fmt: skip


def moe_inputs(device: torch.device, shapes: dict) -> dict:
    """The receive buffer as the dispatch leaves it: `rows_with_tokens` rows routed here, the rest ids -1; x
    rounded to bf16 (the all-to-all's dtype), random MXFP4 experts with E8M0 scales near 1."""
    rows, k, dim, inter, local = (shapes[n] for n in ("rows", "top_k", "dim", "inter", "num_local"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.full((rows, k), -1, dtype=torch.int64)
    used = shapes["rows_with_tokens"]
    ids[:used] = torch.randint(0, local, (used, k), generator=gen)
    packed = [torch.randint(0, 256, s, generator=gen, dtype=torch.int32).to(torch.uint8).to(device)
              for s in ((local, 2 * inter, dim // 2), (local, 2 * inter, dim // 32), (local, dim, inter // 2),
                        (local, dim, inter // 32))]  # fmt: skip
    for s in (packed[1], packed[3]):
        s.clamp_(118, 128)  # E8M0 scales near 1 (at most 2: plugins/moe_mxfp4/layout.py)
    ranks = shapes["recv_ranks"]  # the receive counts of the ep group, summing to rows_with_tokens
    counts = torch.tensor([used // ranks + (r < used % ranks) for r in range(ranks)], dtype=torch.int64)
    return {"x": x, "ids": ids.to(device), "weights": torch.rand(rows, k, generator=gen).to(device),
            "packed": packed, "recv_counts": counts.to(device)}  # fmt: skip


def wall_ms(fn, device: torch.device, calls: int = 1) -> float:
    """Milliseconds per call of `calls` calls of fn, the device synchronized before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e3


def dp_moe_full_and_counted(device: torch.device, shapes: dict, inp: dict, repeats: int) -> dict:
    """Time the expert op over the whole receive buffer (bf16 in and out, as the graph hands it) and in its
    counted-rows mode (recv_counts making `rows_with_tokens` rows valid, `row_bound` rows chunked, bf16 in and
    out), in interleaved rounds (median of each), with the decode-step model's bytes for the full-buffer run and
    the bandwidth they imply, and the counted rows' largest difference from the full-buffer ones."""
    rows, k, dim, inter, local = (shapes[n] for n in ("rows", "top_k", "dim", "inter", "num_local"))
    used = shapes["rows_with_tokens"]
    full_out = torch.empty(rows, dim, dtype=torch.bfloat16, device=device)
    counted_out = torch.empty(rows, dim, dtype=torch.bfloat16, device=device)

    def full():
        moe_mxfp4_triton(inp["x"], inp["ids"], inp["weights"], *inp["packed"], expert_offset=0, out=full_out)

    def counted(tiles=None):
        moe_mxfp4_triton(inp["x"], inp["ids"], inp["weights"], *inp["packed"], expert_offset=0, out=counted_out,
                         recv_counts=inp["recv_counts"], row_bound=shapes["row_bound"], tiles=tiles)  # fmt: skip

    decode_tiles = tile_config(used, local, dim, inter)  # from the rows with tokens, not the row bound

    def counted_decode_tiles():
        counted(decode_tiles)

    full(), counted(), counted_decode_tiles()  # compile
    rounds = [(wall_ms(full, device), wall_ms(counted, device, COUNTED_CALLS_PER_ROUND),
               wall_ms(counted_decode_tiles, device, COUNTED_CALLS_PER_ROUND)) for _ in range(repeats)]  # fmt: skip
    full_ms, counted_ms, decode_tiles_ms = (statistics.median(times) for times in zip(*rounds))
    scale = max(float(full_out[:used].float().abs().max()), 1.0)
    model = full_buffer_moe_op(rows, k, dim, inter, local)
    moved = model["partial_sum_bytes"] + rows * dim * full_out.element_size()  # the model's output is fp32; ours bf16
    return {"dp_moe_full_buffer_ms": full_ms, "dp_moe_counted_ms": counted_ms,
            "dp_moe_counted_speedup": full_ms / counted_ms, "dp_moe_counted_decode_tiles_ms": decode_tiles_ms,
            "decode_tiles": decode_tiles,
            "dp_moe_counted_max_rel_diff": float((counted_out[:used].float() - full_out[:used].float()).abs().max()) / scale,
            "model": model, "counted_model": counted_moe_op(shapes["row_bound"], k, dim, inter, local),
            "model_pass_bytes": moved, "implied_pass_gb_per_s": moved / full_ms / 1e6, "shapes": shapes}  # fmt: skip


def counted_graph_replay(device: torch.device, shapes: dict, inp: dict) -> dict:
    """CUDA only: the counted op (in a caller's workspace) captured into a CUDA graph under sync debug mode "error"
    (a host wait raises), then replayed after the receive counts change in place: its valid rows equal the eager
    run at the new counts, the rows past them unwritten."""
    if device.type != "cuda":
        return {}
    rows, k, dim, inter, local = (shapes[n] for n in ("rows", "top_k", "dim", "inter", "num_local"))
    out = torch.empty(rows, dim, dtype=torch.bfloat16, device=device)
    workspace = torch.empty(workspace_bytes(shapes["row_bound"], k, dim, inter, local), dtype=torch.uint8,
                            device=device)  # fmt: skip

    def run():
        moe_mxfp4_triton(inp["x"], inp["ids"], inp["weights"], *inp["packed"], expert_offset=0, out=out,
                         workspace=workspace, recv_counts=inp["recv_counts"],
                         row_bound=shapes["row_bound"])  # fmt: skip

    run()  # compile, outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n = shapes["rows_with_tokens"] // 2
    inp["recv_counts"].zero_()
    inp["recv_counts"][0] = n
    out.fill_(float("nan"))
    graph.replay()
    replayed = out.clone()
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize(device)
    equal = torch.equal(replayed[:n], out[:n]) and bool(replayed[n:].isnan().all())
    return {"dp_moe_counted_graph_replay_equal": equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run at tiny shapes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = K3_SHAPES if device.type == "cuda" else TINY_SHAPES
    fig = Figures(args.json)  # written after every stage
    with fig.stage("dp_moe_device"):
        fig["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        fig.update(usable_memory(device))
    with fig.stage("dp_moe_inputs"):
        inp = moe_inputs(device, shapes)  # the graph replay, last, changes its receive counts
    if "dp_moe_inputs_error" in fig:
        return
    with fig.stage("dp_moe_timing"):
        fig.update(dp_moe_full_and_counted(device, shapes, inp, args.repeats))
    with fig.stage("dp_moe_graph"):
        fig.update(counted_graph_replay(device, shapes, inp))


if __name__ == "__main__":
    main()

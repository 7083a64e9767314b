"""GPU measurements the TensorRT planner and the dp decode-step model stand on (one H200, < 2 minutes), as JSON.

  - `usable_gpu_bytes`: what CUDA reports as the device's total (torch.cuda.mem_get_info) and what is free once
    a context exists, next to the planner's NVML figure (`export/plan_memory.py` EXPOSED_GPU_BYTES);
  - `dp_moe_full_buffer_ms`: the MoE expert op as the dp layout runs it today (`moe_mxfp4_triton` over the whole
    static receive buffer, K3's shapes: 65,536 rows x 3,584, top-16, 14 local experts of 3,072), at a decode
    step whose rows with tokens are `rows_with_tokens`, with the decode-step model's bytes for it
    (`export/decode_model.py`) and the bandwidth they imply.
The counted-rows op (`dp_moe_counted_speedup`) is not here: it needs the new MoE kernel (see the README's TensorRT
section). Run from the repo root: `python3 benchmarks/gpu_trt_check.py --json $OUT/gpu_trt_check.json`;
`--device cpu` (TRITON_INTERPRET=1) runs the same code at tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from moe_export.export.decode_model import full_buffer_moe_op
from moe_export.export.plan_memory import EXPOSED_GPU_BYTES
from moe_export.plugins.moe_mxfp4.triton_kernel import moe_mxfp4_triton

K3_SHAPES = {"rows": 65536, "top_k": 16, "dim": 3584, "inter": 3072, "num_local": 14, "rows_with_tokens": 48}
TINY_SHAPES = {"rows": 64, "top_k": 2, "dim": 64, "inter": 32, "num_local": 2, "rows_with_tokens": 3}


def usable_memory(device: torch.device) -> dict:
    """CUDA's total and free bytes with a context, and the planner's exposed bytes for an H200."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"usable_gpu_bytes": int(total), "free_after_context_bytes": int(free),
            "planner_exposed_bytes": EXPOSED_GPU_BYTES["h200"]}  # fmt: skip


def dp_moe_full_buffer(device: torch.device, shapes: dict, repeats: int) -> dict:
    """Time the expert op over the whole receive buffer with `rows_with_tokens` rows routed here (the rest -1,
    as the dispatch leaves them), and the model's bytes for it."""
    rows, k, dim, inter, local = (shapes[n] for n in ("rows", "top_k", "dim", "inter", "num_local"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, dim, generator=gen).to(device=device, dtype=torch.bfloat16).float()
    ids = torch.full((rows, k), -1, dtype=torch.int64)
    used = shapes["rows_with_tokens"]
    ids[:used] = torch.randint(0, local, (used, k), generator=gen)
    ids, weights = ids.to(device), torch.rand(rows, k, generator=gen).to(device)
    packed = [torch.randint(0, 256, s, generator=gen, dtype=torch.int32).to(torch.uint8).to(device)
              for s in ((local, 2 * inter, dim // 2), (local, 2 * inter, dim // 32), (local, dim, inter // 2),
                        (local, dim, inter // 32))]  # fmt: skip
    for s in (packed[1], packed[3]):
        s.clamp_(118, 130)  # E8M0 scales near 1
    out = torch.empty(rows, dim, dtype=torch.float32, device=device)

    def run():
        moe_mxfp4_triton(x, ids, weights, *packed, expert_offset=0, out=out)

    run()  # compile
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) / repeats * 1e3
    model = full_buffer_moe_op(rows, k, dim, inter, local)
    moved = model["partial_sum_bytes"] + model["output_bytes"]
    return {"dp_moe_full_buffer_ms": ms, "model": model, "model_pass_bytes": moved,
            "implied_pass_gb_per_s": moved / ms / 1e6, "shapes": shapes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run at tiny shapes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = K3_SHAPES if device.type == "cuda" else TINY_SHAPES
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **usable_memory(device), **dp_moe_full_buffer(device, shapes, args.repeats)}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""MXFP4 codec throughput on CPU: our encode vs torchao's `to_mx` and a plain memory copy, plus decode.

All figures come from one run on the same bf16 tensors (K3 routed-expert shapes), interleaving the
methods round by round and keeping each method's best round, so machine noise hits them alike.
Throughputs are GB/s (1e9 bytes per second) of bf16 input for encode and copy, and of bf16
output for decode.

    python benchmarks/quantize.py [--experts 1] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch

from moe_export.quantize import mxfp4

# One K3 routed expert, logical [out, in]: w1 (gate), w3 (up), w2 (down).
K3_EXPERT_SHAPES = ((3072, 3584), (3072, 3584), (3584, 3072))


def make_tensors(experts: int, seed: int) -> list[torch.Tensor]:
    """bf16 weights of `experts` K3 experts, N(0, 1/in) with a few heavy outliers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(experts):
        for rows, cols in K3_EXPERT_SHAPES:
            w = torch.randn(rows, cols, generator=g) * cols**-0.5
            w.view(-1)[torch.randint(0, w.numel(), (w.numel() // 10000,), generator=g)] *= 50
            out.append(w.to(torch.bfloat16))
    return out


def best_time(fn: Callable[[], object], best: float) -> float:
    t0 = time.perf_counter()
    fn()
    return min(best, time.perf_counter() - t0)


def run(experts: int, rounds: int, seed: int) -> dict:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode

    def torchao_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
        return m.qdata.view(torch.uint8), m.scale.view(torch.uint8)

    xs = make_tensors(experts, seed)
    nbytes = sum(x.numel() * x.element_size() for x in xs)
    copies = [torch.empty_like(x) for x in xs]
    encoded = [mxfp4.encode(x) for x in xs]
    identical = all(
        torch.equal(p, pr) and torch.equal(s, sr) for (p, s), (pr, sr) in zip(encoded, (torchao_encode(x) for x in xs))
    )
    methods: dict[str, Callable[[], object]] = {
        "encode": lambda: [mxfp4.encode(x) for x in xs],
        "torchao_encode": lambda: [torchao_encode(x) for x in xs],
        "memcpy": lambda: [c.copy_(x) for c, x in zip(copies, xs)],
        "decode": lambda: [mxfp4.decode(p, s, torch.bfloat16) for p, s in encoded],
    }
    best = {k: float("inf") for k in methods}
    for _ in range(rounds):
        for k, fn in methods.items():
            best[k] = best_time(fn, best[k])
    gbps = {k: nbytes / t / 1e9 for k, t in best.items()}
    return {
        "input_bytes": nbytes,
        "tensors": len(xs),
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "loadavg_1min": os.getloadavg()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "encode_matches_torchao": identical,
        "encode_gbps": gbps["encode"],
        "torchao_encode_gbps": gbps["torchao_encode"],
        "memcpy_gbps": gbps["memcpy"],
        "decode_gbps": gbps["decode"],
        "encode_speedup_vs_torchao": best["torchao_encode"] / best["encode"],
        "encode_fraction_of_memcpy": best["memcpy"] / best["encode"],
        "decode_fraction_of_memcpy": best["memcpy"] / best["decode"],
        "encode_s": best["encode"],
        "torchao_encode_s": best["torchao_encode"],
        "memcpy_s": best["memcpy"],
        "decode_s": best["decode"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=1, help="K3 experts' worth of bf16 weights (3 tensors, 66 MB each)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per method (best kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.experts, args.rounds = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.experts, args.rounds, args.seed)
    print(f"MXFP4 codec, {r['input_bytes'] / 1e6:.0f} MB bf16 in {r['tensors']} tensors, {r['threads']} threads, best of {r['rounds']}, "
          f"load average {r['loadavg_1min']:.1f}")
    print(f"  encode (ours)       {r['encode_gbps']:7.3f} GB/s   {r['encode_s'] * 1e3:8.1f} ms")
    print(f"  encode (torchao)    {r['torchao_encode_gbps']:7.3f} GB/s   {r['torchao_encode_s'] * 1e3:8.1f} ms")
    print(f"  memcpy              {r['memcpy_gbps']:7.3f} GB/s   {r['memcpy_s'] * 1e3:8.1f} ms")
    print(f"  decode -> bf16      {r['decode_gbps']:7.3f} GB/s   {r['decode_s'] * 1e3:8.1f} ms")
    print(f"  encode speedup vs torchao: {r['encode_speedup_vs_torchao']:.1f}x (goal >= 2x); "
          f"encode = {r['encode_fraction_of_memcpy']:.3f} of memcpy; bit-identical to torchao: {r['encode_matches_torchao']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()

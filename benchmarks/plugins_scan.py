"""Benchmark of the CPU gated delta scan (KDA core) and short conv, on 2 threads.

gated_delta_scan at T=4096 (quick: 1024), H=4, K=V=128, l2-normalised q/k, K3 safe gate g in (-5, 0):
``moe_export.plugins.gated_delta_scan.cpu`` vs transformers' torch ``recurrent_kimi_delta_attention`` and
``chunk_kimi_delta_attention`` (run in a subprocess with ``sys.modules['fla'] = None`` so that transformers
uses its torch fallbacks; 2 threads there too) and vs the naive per-token recurrence (``reference``).
Times are the best of the same number of interleaved rounds for every implementation, in seconds. ``run()`` returns a flat dict; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

THREADS = 2
H, K, V = 4, 128, 128

TRANSFORMERS_SCRIPT = r"""
import json, sys, time, torch
sys.modules["fla"] = None
from transformers.models.kimi_linear import modeling_kimi_linear as m
torch.set_num_threads(int(sys.argv[3]))
x = torch.load(sys.argv[1])
res = {}
for name in ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention"):
    fn = getattr(m, name)
    best = float("inf")
    for _ in range(int(sys.argv[4])):
        t0 = time.perf_counter()
        o, _ = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        best = min(best, time.perf_counter() - t0)
    res[name] = best
    torch.save(o, sys.argv[2] + "." + name)
print(json.dumps(res))
"""


def _inputs(T: int, seed: int = 0):
    """q, k, v [1, T, H, K|V]; g = -5 * sigmoid(.) (K3 safe gate); beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return q, k, v, g, beta


def _best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _transformers_times(inputs, repeats: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Seconds and outputs of transformers' two torch KDA paths (empty dicts if transformers is missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out")
        torch.save(dict(zip(("q", "k", "v", "g", "beta"), inputs)), src)
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
        r = subprocess.run(
            [sys.executable, "-c", TRANSFORMERS_SCRIPT, src, out, str(THREADS), str(repeats)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            return {}, {}
        times = json.loads(r.stdout.strip().splitlines()[-1])
        return times, {name: torch.load(f"{out}.{name}") for name in times}


def _short_conv_time(T: int, repeats: int) -> float:
    """Seconds for one packed prefill of the K3-sized q/k/v conv of 4 heads (C = 3 * H * K)."""
    from moe_export.plugins.short_conv import cpu as conv_cpu

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, 3 * H * K, generator=gen)
    w = torch.randn(3 * H * K, 1, 4, generator=gen)
    return _best_time(lambda: conv_cpu.short_conv(x, w, output_final_state=True), repeats)[0]


def run(quick: bool = False) -> dict:
    """Flat dict of figures (seconds, speedups, relative error); quick uses T=1024 and fewer repeats."""
    from moe_export.plugins.gated_delta_scan import cpu, reference

    torch.set_num_threads(THREADS)
    T = 1024 if quick else 4096
    repeats = 2 if quick else 5
    inputs = _inputs(T)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    # Interleaved rounds, one timed call of every implementation per round, best round kept for each: the
    # same repetitions for ours, the naive recurrence and transformers (in a child process per round).
    cpu_s = naive_s = float("inf")
    tf_times: dict[str, float] = {}
    for _ in range(repeats):
        t, (o_cpu, _) = _best_time(lambda: cpu.gated_delta_scan(*inputs, **kw), 1)
        cpu_s = min(cpu_s, t)
        t, (o_naive, _) = _best_time(lambda: reference.gated_delta_scan(*inputs, **kw), 1)
        naive_s = min(naive_s, t)
        round_times, tf_outs = _transformers_times(inputs, 1)
        tf_times = {k: min(v, tf_times.get(k, float("inf"))) for k, v in round_times.items()}
    scale = float(o_naive.abs().max())
    figures = {
        "kda_T": T,
        "kda_H": H,
        "kda_K": K,
        "kda_V": V,
        "threads": THREADS,
        "kda_rounds": repeats,
        "kda_cpu_s": cpu_s,
        "kda_naive_s": naive_s,
        "kda_speedup_vs_naive": naive_s / cpu_s,
        "kda_cpu_max_rel_err_vs_naive": float((o_cpu - o_naive).abs().max()) / scale,
        "kda_transformers_recurrent_s": tf_times.get("recurrent_kimi_delta_attention"),
        "kda_transformers_chunk_s": tf_times.get("chunk_kimi_delta_attention"),
        "kda_speedup_vs_transformers": min(tf_times.values()) / cpu_s if tf_times else None,
        "kda_cpu_max_rel_err_vs_transformers": (
            max(float((o_cpu - o).abs().max()) for o in tf_outs.values()) / scale if tf_outs else None
        ),
    }
    decode = _inputs(1, seed=2)
    state = torch.zeros(1, H, K, V)
    figures["kda_cpu_decode_step_s"] = _best_time(
        lambda: cpu.gated_delta_scan(*decode, initial_state=state, **kw), repeats * 4
    )[0]
    figures["short_conv_T"] = T
    figures["short_conv_C"] = 3 * H * K
    figures["short_conv_cpu_s"] = _short_conv_time(T, repeats)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=1024 and fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    figures = run(quick=args.quick)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

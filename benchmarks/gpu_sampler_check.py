"""The runner's batched sampler (`runtime/engine/sampler.py`) on the device the TensorRT runner samples on.

Part of `benchmarks/gpu_check.sh` (the one prepared GPU run); `--device cpu` is the dry run the CPU tests make
(tests/test_gpu_check.py) so that this script is known to run before a GPU is lent.

For batch sizes 1 / 16 / 64 / 256 (`--batches`) over logits [B, 163,840] (K3's vocabulary, `--vocab`) on the
device (on CUDA the Triton kernels of `runtime/engine/sampler_kernels.py`): milliseconds per `sample` call for
greedy rows (temperature 0) and for temperature 1 / top-p 0.95 rows, and their ratio (`sampler_ms_greedy_B`,
`sampler_ms_top_p_B`, `sampler_top_p_over_greedy_B`). Each call gets a fresh copy of the logits (untimed; the
sampler may work in place) and ends with the ids copied to the host, as in the runner, so the wall time of a
call is the device time plus that copy.
Then the checks on the device: the greedy ids equal torch.argmax's (`sampler_greedy_equals_torch_argmax`);
every row of a seeded batch draws the same token when sampled alone as in the batch
(`sampler_seeded_alone_equals_batch`, must be true), and how many of them the CPU draws too for the same logits
(`sampler_seeded_device_equals_cpu_frac`: the draw is a hash of seed and counter, so only rounding of the
device's softmax can move a draw across a boundary).
`--json PATH` writes the figures as one flat object.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]

from moe_export.runtime.engine.sampler import SamplingBatch, sample

K3_VOCAB = 163_840


def sampling_batch(n: int, temperature: float, top_p: float, seed0: int = 1234) -> SamplingBatch:
    """Host SamplingBatch for rows 0..n-1: one temperature / top-p for all, seeds seed0.., counters 0.."""
    return SamplingBatch(
        rows=torch.arange(n), temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.long),
        top_p=torch.full((n,), top_p), min_p=torch.zeros(n), seed=torch.arange(seed0, seed0 + n, dtype=torch.long),
        counter=torch.arange(n, dtype=torch.long), forced=torch.full((n,), -1, dtype=torch.long),
        logprobs=torch.full((n,), -1, dtype=torch.long),
    )  # fmt: skip


def row_batch(sb: SamplingBatch, row: int) -> SamplingBatch:
    """The one-row batch of `sb`'s row `row` (its own seed and counter), sampling row 0 of a [1, V] logits."""
    fields = {k: (v[row : row + 1] if isinstance(v, torch.Tensor) else v) for k, v in sb.__dict__.items()}
    fields["rows"] = torch.zeros(1, dtype=torch.long)
    return SamplingBatch(**fields)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_call(fn, prepare, device: torch.device, repeats: int) -> float:
    """Median wall milliseconds of `fn()` after one warm-up call; `prepare()` runs untimed before each call."""
    prepare()
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        prepare()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def logits_for(n: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Peaked logits like a model's (a few likely tokens, a long tail), fp32 on `device`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen) * 2.0
    return x.to(device)


def check_sampler(fig: dict, device: torch.device, batches: list[int], vocab: int, repeats: int) -> None:
    for n in batches:
        logits = logits_for(n, vocab, device)
        work = torch.empty_like(logits)  # the sampler may work in place on the logits it gets: a fresh copy each call
        greedy = sampling_batch(n, 0.0, 1.0).to(device)
        top_p = sampling_batch(n, 1.0, 0.95).to(device)
        refill = lambda work=work, logits=logits: work.copy_(logits)  # noqa: E731
        fig[f"sampler_ms_greedy_{n}"] = ms_per_call(lambda work=work, greedy=greedy: sample(work, greedy), refill, device, repeats)
        fig[f"sampler_ms_top_p_{n}"] = ms_per_call(lambda work=work, top_p=top_p: sample(work, top_p), refill, device, repeats)
        fig[f"sampler_top_p_over_greedy_{n}"] = fig[f"sampler_ms_top_p_{n}"] / fig[f"sampler_ms_greedy_{n}"]
    n = max(batches)
    logits = logits_for(n, vocab, device, seed=1)
    sb = sampling_batch(n, 1.0, 0.95)
    greedy = sample(logits.clone(), sampling_batch(n, 0.0, 1.0).to(device)).ids
    fig["sampler_greedy_equals_torch_argmax"] = bool((torch.from_numpy(greedy) == logits.argmax(dim=1).cpu()).all())
    together = sample(logits.clone(), sb.to(device)).ids
    rows = sorted({0, n // 3, n // 2, n - 1})
    alone = [int(sample(logits[r : r + 1].clone(), row_batch(sb, r).to(device)).ids[0]) for r in rows]
    fig["sampler_seeded_rows_checked"] = len(rows)
    fig["sampler_seeded_alone_equals_batch"] = alone == [int(together[r]) for r in rows]
    on_cpu = sample(logits.cpu().clone(), sb).ids
    fig["sampler_seeded_device_equals_cpu_frac"] = float((on_cpu == together).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the GPU run) or cpu (the dry run of the CPU tests)")
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--vocab", type=int, default=K3_VOCAB)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        device = torch.device(args.device)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    if min(batches) < 1 or args.vocab < 2 or args.repeats < 1:
        parser.error("batch sizes and repeats must be >= 1, the vocabulary >= 2")
    fig = Figures(args.json, sampler_vocab=args.vocab)  # written after every stage
    if device.type == "cuda" and not torch.cuda.is_available():
        fig["sampler_error"] = "RuntimeError: --device cuda: no CUDA device here (use --device cpu for the dry run)"
        fig.write()
        parser.error(fig["sampler_error"].removeprefix("RuntimeError: "))
    with fig.stage("sampler"):
        fig["sampler_device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        check_sampler(fig, device, batches, args.vocab, args.repeats)


if __name__ == "__main__":
    main()

"""Host overhead per decode step: what the runtime's host side costs when the model step itself is free.

    python benchmarks/host_overhead.py [--steps 20] [--rounds 5] [--threads T] [--device-ms 3] [--json out.json]
    python benchmarks/host_overhead.py --smoke   # tiny sizes (seconds): the code path only, no figure to read

Part 1, the engine core over a runner that returns sampled ids at once (no model, no sampling): `LLM`'s core
(scheduler, sampling-batch packing, step packing, output processing, detokenization, stop checks) driving B
decoding sequences, B = 1 / 16 / 64 / 256 -> `host_ms_per_step_{B}` (best round's mean over --steps steps), with
the overlap off (the runner is instant: the whole host cost per step).
Part 2, the runner's batched sampler alone (`runtime.engine.sampler.sample`, CPU torch) on logits
[B, 163840] (K3's vocabulary): temperature 0 (`sampler_ms_{B}_greedy`, the argmax floor) and temperature 1 +
top-p 0.95 (`sampler_ms_{B}_sampled`), on flat logits (standard normal: the top-p set is most of the
vocabulary, so every row takes the whole-row path) and on peaked ones (`_peaked`: normal x 4, the shape of a
trained model's next-token distribution, where the candidates hold the top-p mass); `sampled_over_greedy_64`
(flat) and `sampled_over_greedy_64_peaked`. The old per-request sampler is gone (`legacy_ms_per_step_256_sampled`
is reported as null with `legacy_path`).
Part 3, overlap: the same core at B = 256 over a runner whose step takes --device-ms and leaves the CPU free (it
sleeps, as a host thread waiting on a GPU stream does), with the overlap off (`serial_ms_per_step_256`: host then
device, each step) and on (`overlap_ms_per_step_256`: the host plans step N+1 and processes step N's outputs while
step N runs); `overlap_speedup_256` = serial / overlap (at most (host + device) / max(host, device)).
`loadavg_1min` is read before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_export.export.convert.synth import write_synthetic_tokenizer
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch, sample
from moe_export.runtime.client.llm import LLM
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.tokenizer import load_tokenizer

VOCAB = 163_840
BATCHES = (1, 16, 64, 256)
SMOKE_BATCHES = (1, 4)  # --smoke: the batches of every part (the overlap part runs at the largest)


class InstantRunner:
    """A ModelRunner whose step costs nothing: it returns the next ids of a fixed token stream at once."""

    def __init__(self, num_slots: int, token_ids: np.ndarray) -> None:
        self.num_slots, self.block_size, self.max_seq_len = num_slots, 64, 1 << 16
        self.num_blocks = num_slots * (self.max_seq_len // self.block_size)
        self.max_num_tokens, self.max_step_pairs = 1 << 16, None
        self.num_checkpoints, self.checkpoint_interval = 0, 0  # no checkpoint pool: no prefix caching
        self.world_size, self.comm, self.is_root = 1, None, True
        self.config, self.model_config = None, {"vocab_size": VOCAB}  # no EngineConfig: not built
        self.vision, self.dp_layout = None, False
        self.tokens, self.at = token_ids, 0

    def reset_slot(self, slot: int) -> None:
        pass

    def step(self, batch):
        raise NotImplementedError("the instant runner returns sampled ids only")

    def sample(self, batch, sampling: SamplingBatch | None) -> SampledTokens | None:
        n = int(sampling.rows.shape[0])
        take = np.take(self.tokens, np.arange(self.at, self.at + n), mode="wrap")
        self.at += n
        return SampledTokens(take, [None] * n, [None] * n)


class DeviceRunner(InstantRunner):
    """An InstantRunner whose step takes `device_ms` without using the CPU (a GPU step's wait on its stream)."""

    def __init__(self, num_slots: int, token_ids: np.ndarray, device_ms: float) -> None:
        super().__init__(num_slots, token_ids)
        self.device_s = device_ms / 1e3

    def sample(self, batch, sampling: SamplingBatch | None) -> SampledTokens | None:
        time.sleep(self.device_s)
        return super().sample(batch, sampling)


def host_ms_per_step(engine_dir: Path, batch: int, steps: int, rounds: int, tokens: np.ndarray,
                     device_ms: float = 0.0, overlap: bool = False) -> float:
    """Best round's mean ms per decode step of B sequences. Default: an instant runner with the overlap off (there
    is nothing to overlap: the step's whole host cost); device_ms: a runner step of that length."""
    runner = DeviceRunner(batch, tokens, device_ms) if device_ms else InstantRunner(batch, tokens)
    llm = LLM(engine_dir, runner=runner, reuse_sessions=False, overlap=overlap)
    core = llm._root()
    params = SamplingParams(max_tokens=60_000, ignore_eos=True, stop=("\x00never",))
    for i in range(batch):
        core.submit(llm.prepare_generate(np.take(tokens, np.arange(i, i + 8), mode="wrap").tolist(), params), None)
    for _ in range(3):  # prefill + first decode steps
        core.step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            deltas = core.step()
        best = min(best, (time.perf_counter() - start) / steps)
        assert len(deltas) == batch
    llm.shutdown()
    return best * 1e3


def sampler_batch(n: int, temperature: float, top_p: float) -> SamplingBatch:
    return SamplingBatch(rows=torch.arange(n), temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.long),
                         top_p=torch.full((n,), top_p), min_p=torch.zeros(n), seed=torch.arange(n, dtype=torch.long),
                         counter=torch.zeros(n, dtype=torch.long), forced=torch.full((n,), -1),
                         logprobs=torch.full((n,), -1))


def sampler_ms(logits: torch.Tensor, temperature: float, top_p: float, rounds: int) -> float:
    sb = sampler_batch(logits.shape[0], temperature, top_p)
    best = float("inf")
    for _ in range(rounds):
        x = logits.clone()  # the sampler works in place on the runner's logits; the copy is outside the timing
        start = time.perf_counter()
        sample(x, sb)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device-ms", type=float, default=3.0, help="part 3: the simulated device step (ms)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the code runs, no figures")
    args = ap.parse_args()
    batches, big = (SMOKE_BATCHES, SMOKE_BATCHES[-1]) if args.smoke else (BATCHES, 256)
    if args.smoke:
        args.steps, args.rounds, args.device_ms = 2, 1, 0.5
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"loadavg_1min_before": os.getloadavg()[0], "threads": torch.get_num_threads(), "vocab": VOCAB}
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_tokenizer(Path(tmp), "k3", 4096)
        tok = load_tokenizer(tmp)
        ordinary = np.array([i for i in range(32, tok.vocab_size) if not tok.is_special(i)], dtype=np.int64)
        for b in batches:
            result[f"host_ms_per_step_{b}"] = round(host_ms_per_step(Path(tmp), b, args.steps, args.rounds, ordinary), 3)
            print(f"host_ms_per_step_{b}: {result[f'host_ms_per_step_{b}']}", flush=True)
        result["device_ms"] = args.device_ms
        for _ in range(2):  # interleaved rounds: serial, overlap, serial, overlap (best of each)
            for key, overlap in (("serial_ms_per_step_256", False), ("overlap_ms_per_step_256", True)):
                ms = host_ms_per_step(Path(tmp), big, args.steps, args.rounds, ordinary, args.device_ms, overlap)
                result[key] = round(min(ms, result.get(key, float("inf"))), 3)
        result["overlap_speedup_256"] = round(result["serial_ms_per_step_256"] / result["overlap_ms_per_step_256"], 2)
        print(f"device step {args.device_ms} ms at B=256: serial {result['serial_ms_per_step_256']} ms, overlap "
              f"{result['overlap_ms_per_step_256']} ms per step ({result['overlap_speedup_256']}x)", flush=True)
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        flat = torch.randn(b, VOCAB, generator=gen)
        for suffix, logits in (("", flat), ("_peaked", flat * 4)):
            result[f"sampler_ms_{b}_greedy{suffix}"] = round(sampler_ms(logits, 0.0, 1.0, args.rounds), 3)
            result[f"sampler_ms_{b}_sampled{suffix}"] = round(sampler_ms(logits, 1.0, 0.95, args.rounds), 3)
            print(f"sampler_ms_{b}{suffix}: greedy {result[f'sampler_ms_{b}_greedy{suffix}']} "
                  f"sampled {result[f'sampler_ms_{b}_sampled{suffix}']}", flush=True)
        del flat
    for suffix in ("", "_peaked"):
        mid = 64 if 64 in batches else batches[-1]
        result[f"sampled_over_greedy_64{suffix}"] = round(result[f"sampler_ms_{mid}_sampled{suffix}"]
                                                          / result[f"sampler_ms_{mid}_greedy{suffix}"], 2)
    result["legacy_ms_per_step_256_sampled"] = None
    result["legacy_path"] = "gone: the per-request sampler was replaced by the runner's batched sampler"
    result["loadavg_1min"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

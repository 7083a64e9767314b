"""Runtime: continuous batching throughput and session-reuse time to first token.

Builds the embedded default (tiny-cpu recipe: synthetic tiny-k3, tp=2 ep=2, all 4 ranks in this process)
twice with runtime limits for each job (256 tokens per step; max_seq_len just above the sequences: short
for batching, just above the history for reuse), runs right-sized cache pools, and measures through the
public `LLM` API, in interleaved rounds with equal repetitions:

  batching_speedup_16   aggregate generated tokens/s of 16 requests submitted together (one
                        `generate` call, continuous batching) / tokens/s of one request alone, on
                        the same 16-slot LLM (reuse off; 32-token prompts, TOKENS generated,
                        prefill included in both). Goal >= 4.
  reuse_ttft_speedup    time to first token of a follow-up turn after HISTORY tokens of history:
                        with state reuse (the previous turn's kept state continues) / with a full
                        re-prefill (a second 2-slot LLM with reuse off, the same prompt). Goal >= 5.
  peak_rss_gib          the process's peak resident memory over the run (the three LLMs together).

    python benchmarks/runtime.py [--rounds 3] [--history 2000] [--tokens 32] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.runtime.client.llm import LLM
from moe_export.runtime.sampling import SamplingParams

BATCH = 16
PROMPT = 32
NEW_TURN = 24  # tokens a follow-up turn adds after the previous output
BLOCK = 64


def build_engine(root: Path, name: str, max_seq_len: int) -> Path:
    recipe = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    recipe["name"] = name
    recipe["limits"].update({"max_batch": BATCH, "max_seq_len": max_seq_len, "max_num_tokens": 256, "block_size": BLOCK})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = root / name
    build(load_recipe(path)[0], out)
    return out


def right_sized_llm(engine_dir: Path, slots: int, max_seq_len: int, threads: int, **kwargs) -> LLM:
    """An LLM whose cache pool holds `slots` sequences of max_seq_len (not the planner's memory-sized default)."""
    return LLM(engine_dir, num_slots=slots, num_blocks=slots * -(-max_seq_len // BLOCK), threads=threads, **kwargs)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=2000, help="history tokens before the follow-up turn")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request (batching)")
    parser.add_argument("--quick", action="store_true", help="1 round, history 300, 8 tokens: checks the script runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.history, args.tokens = 1, 300, 8
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        threads = min(2, os.cpu_count() or 1)
        short_len, long_len = PROMPT + args.tokens + 32, args.history + 8 + NEW_TURN + 64
        batch_dir = build_engine(Path(tmp), "runtime-bench-batch", short_len)
        ttft_dir = build_engine(Path(tmp), "runtime-bench-ttft", long_len)
        batching = right_sized_llm(batch_dir, BATCH, short_len, threads, reuse_sessions=False, prefix_caching=False)
        reuse = right_sized_llm(ttft_dir, 2, long_len, threads)
        full = right_sized_llm(ttft_dir, 2, long_len, threads, reuse_sessions=False, prefix_caching=False)
        vocab = reuse.tokenizer.vocab_size
        gen = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        first_token = SamplingParams(max_tokens=1, ignore_eos=True)
        t_batch, t_single, t_reuse, t_full = [], [], [], []
        for _ in range(args.rounds):
            prompts = [random_ids(rng, PROMPT, vocab) for _ in range(BATCH)]
            t_single.append(timed(lambda prompts=prompts: batching.generate([prompts[0]], gen)))
            t_batch.append(timed(lambda prompts=prompts: batching.generate(prompts, gen)))
            history = random_ids(rng, args.history, vocab)
            turn = reuse.generate([history], SamplingParams(max_tokens=8, ignore_eos=True))[0]  # untimed first turn
            follow_up = history + turn.output_ids + random_ids(rng, NEW_TURN, vocab)
            out = []
            t_full.append(timed(lambda out=out, follow_up=follow_up: out.append(full.generate([follow_up], first_token)[0])))
            t_reuse.append(timed(lambda out=out, follow_up=follow_up: out.append(reuse.generate([follow_up], first_token)[0])))
            assert out[1].usage["cached_tokens"] == len(history) + 7, out[1].usage
            assert out[0].usage["cached_tokens"] == 0 and out[0].output_ids == out[1].output_ids
        for llm in (batching, reuse, full):
            llm.shutdown()
    single_tps = args.tokens / statistics.median(t_single)
    batch_tps = BATCH * args.tokens / statistics.median(t_batch)
    figures = {
        "batching_speedup_16": batch_tps / single_tps,
        "tokens_per_s_batch16": batch_tps,
        "tokens_per_s_batch1": single_tps,
        "reuse_ttft_speedup": statistics.median(t_full) / statistics.median(t_reuse),
        "ttft_s_reuse": statistics.median(t_reuse),
        "ttft_s_full_prefill": statistics.median(t_full),
        "history_tokens": args.history,
        "tokens_per_request": args.tokens,
        "rounds": args.rounds,
        "loadavg_1min": os.getloadavg()[0],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB; 3 LLMs in process
    }
    for key, value in figures.items():
        print(f"{key:28s} {value:10.3f}")
    if args.json:
        tmp_path = args.json.with_name(args.json.name + ".tmp")
        tmp_path.write_text(json.dumps(figures, indent=2, sort_keys=True))
        tmp_path.replace(args.json)


if __name__ == "__main__":
    main()

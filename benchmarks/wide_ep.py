"""Wide expert parallelism: the dp layout (attention groups + all-to-all experts) against today's tp layout.

Same model (synthetic tiny-k3), same 8 ranks under `mpiexec -n 8`, same requests (REQUESTS concurrent, PROMPT-token
prompts, TOKENS generated each, greedy, eos ignored), one `LLM.generate` call on rank 0 timed end to end (prefill
included), after a warm-up request:

  tp layout   tp 2, ep 8, attention tp: every rank runs the one batch, expert partial sums all-reduced over 8 ranks
  dp layout   tp 2 x dp 4, ep 8: four attention groups with their own requests, tokens dispatched by all-to-all

  wide_ep_throughput_ratio   generated tokens/s, dp / tp (goal >= 2)
  moe_bytes_per_token_ratio  bytes sent per token per MoE layer, dp / tp, counted by the runtime from what its
                             collectives send (all-to-all: rows, ids, weights and counts that leave a rank, the tp
                             group's all-gather of the shares; all-reduce: a ring's 2 (n - 1) / n of the payload)
  expert_load_max_over_mean  busiest expert's routed tokens / the mean, per MoE layer, worst layer (dp run)
  redundant_work_ratio       the model's work per generated token, tp / dp: thread CPU seconds inside the ONNX
                             Runtime segment runs (one intra-op thread, so the kernels run on the calling thread;
                             collectives, MPI waits and preemption are not counted), summed over the 8 ranks,
                             timed steps only. What the tp layout repeats (attention and the dense / shared FFNs
                             in every tp group) shows here whatever the machine.
  compute_share              per layout: those CPU seconds / (8 ranks x the run's wall time): how much of the
                             ranks' time is the model's work on this machine (the rest is waiting for the CPU
                             and for the other ranks in collectives)
  loadavg_1min, loadavg_1min_end   the machine's load before and after the runs (figures at load > 1.5 are not
                             evidence)

With --paper: the README's paper model for 8x8 H100 (`export/plan/traffic.py`), no runs.

    python benchmarks/wide_ep.py [--requests 32] [--tokens 16] [--prompt 24] [--json PATH] [--paper]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

WORLD = 8


def build_engine(root: Path, attention: str, requests: int, max_seq_len: int) -> Path:
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    data = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    data["name"] = f"wide-ep-{attention}"
    data["target"]["gpus_per_node"] = WORLD
    data["parallel"] = {"tp": 2, "ep": WORLD, "attention": attention}
    data["limits"].update({"max_batch": requests, "max_seq_len": max_seq_len, "max_num_tokens": 512, "block_size": 16})
    path = root / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    build(load_recipe(path)[0], root / data["name"])
    return root / data["name"]


def time_model_work(engine) -> list[float]:
    """Per engine step of this process, the thread CPU seconds spent in its ranks' ONNX Runtime segment runs (the
    expert segments included): the model's work, without collectives, waits or time preempted."""
    from moe_export.runtime.engine import ort

    steps: list[float] = []

    def timed(run):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                steps[-1] += time.thread_time() - start

        return wrapper

    for name in ("run_segment", "run_experts"):
        setattr(ort.RankRunner, name, timed(getattr(ort.RankRunner, name)))
    run_step = engine._run

    def counted(*args, **kwargs):
        steps.append(0.0)
        return run_step(*args, **kwargs)

    engine._run = counted
    return steps


def rank_main(engine_dir: str, requests: int, prompt: int, tokens: int) -> None:
    """One rank of the measured run (under mpiexec). Every rank runs one engine step per world step (lockstep), so
    rank 0's step count at the start of the timed call marks the warm-up steps on every rank."""
    import numpy as np
    from moe_export.runtime import LLM
    from moe_export.runtime.sampling import SamplingParams

    llm = LLM(engine_dir, threads=1, reuse_sessions=False, prefix_caching=False)
    engine = llm.engine
    work = time_model_work(engine)
    if not engine.is_root:
        llm.run_follower()
        engine.comm.world.gather((engine.traffic, engine.expert_tokens, work), root=0)
        return
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, prompt).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([prompts[0][:4]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up (sessions, first runs)
    warm = len(work)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.shutdown()
    parts = engine.comm.world.gather((engine.traffic, engine.expert_tokens, work), root=0)
    steps = {len(w) for _, _, w in parts}
    if len(steps) != 1:
        raise SystemExit(f"ranks ran different step counts {sorted(steps)}: not lockstep")
    cpu = sum(sum(w[warm:]) for _, _, w in parts)
    sent: dict[str, int] = {}
    for traffic, _, _ in parts:
        for kind, n in traffic.sent_bytes.items():
            sent[kind] = sent.get(kind, 0) + n
    moe_tokens = sum(t.moe_tokens for t, _, _ in parts)
    moe_bytes = sum(n for kind, n in sent.items() if kind.startswith("moe_"))
    load = np.sum([e for _, e, _ in parts], axis=0)
    worst = float(max((row.max() / row.mean() for row in load if row.sum()), default=0.0))
    generated = sum(len(o.output_ids) for o in outs)
    print(json.dumps({"generated_tokens": generated, "seconds": seconds, "timed_steps": len(work) - warm,
                      "model_cpu_seconds": cpu, "compute_share": cpu / (WORLD * seconds),
                      "moe_bytes_per_token_layer": moe_bytes / moe_tokens if moe_tokens else 0.0,
                      "sent_bytes": sent, "expert_load_max_over_mean": worst}))


def run(engine_dir: Path, requests: int, prompt: int, tokens: int) -> dict:
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", str(WORLD), sys.executable, __file__, "--rank-run", str(engine_dir),
                        "--requests", str(requests), "--prompt", str(prompt), "--tokens", str(tokens)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"mpiexec run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def paper() -> dict:
    """The README's paper model: K3 (h100x64 recipe's per-GPU bytes) on 8x8 H100, batch 256 per group."""
    from moe_export.common.recipe import load_recipe
    from moe_export.export.plan.planner import (
        GIB,
        cache_bytes_per_token,
        make_plan,
        recurrent_bytes_per_sequence,
    )
    from moe_export.export.plan.traffic import H100_8X8, decode_paper_model
    from moe_export.graphs.sharding import Mapping

    rec, _ = load_recipe("h100x64.yaml")
    plan = make_plan(rec)
    w = plan.per_rank[0].weight_bytes
    streamed = w["total"] - w.get("embeddings", 0) - w.get("vision", 0)  # a lookup, and no images while decoding
    state = sum(recurrent_bytes_per_sequence(plan.config, rec, Mapping(64, 0, 8, 64, "dp")).values())
    cache = sum(cache_bytes_per_token(plan.config, rec).values())
    out = {"hardware": H100_8X8.name, "assumptions": {
        "hbm_bytes_per_s": H100_8X8.hbm, "hbm_efficiency": H100_8X8.hbm_efficiency, "bf16_flops": H100_8X8.flops,
        "mfu": H100_8X8.mfu, "nvlink_bytes_per_s_per_direction": H100_8X8.nvlink,
        "network_bytes_per_s_per_gpu": H100_8X8.network, "streamed_weight_gib_per_gpu": streamed / GIB,
        "recurrent_state_mib_per_sequence": state / 2**20, "cache_bytes_per_token": cache}}
    for context in (2048, 8192):
        for layout in ("tp", "dp"):
            out[f"{layout}_ctx{context}"] = decode_paper_model(
                plan.config, layout, weight_bytes_per_gpu=streamed, expert_bytes_per_gpu=w["routed_experts"],
                state_bytes_per_sequence=state, cache_bytes_per_token=cache, context=context, world=64, tp=8,
                gpus_per_node=8, batch=256)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--paper", action="store_true")
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.prompt, args.tokens = 4, 8, 2
    if args.rank_run:
        rank_main(args.rank_run, args.requests, args.prompt, args.tokens)
        return
    if args.paper:
        figures = paper()
    else:
        load_start = os.getloadavg()[0]
        print(f"loadavg_1min {load_start:.2f}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            max_seq = args.prompt + args.tokens + 16
            runs = {layout: run(build_engine(Path(tmp), layout, args.requests, max_seq), args.requests, args.prompt,
                                args.tokens) for layout in ("tp", "dp")}
        rate = {k: r["generated_tokens"] / r["seconds"] for k, r in runs.items()}
        figures = {
            "wide_ep_throughput_ratio": rate["dp"] / rate["tp"],
            "moe_bytes_per_token_ratio": runs["dp"]["moe_bytes_per_token_layer"] / runs["tp"]["moe_bytes_per_token_layer"],
            "tokens_per_s": rate, "moe_bytes_per_token_layer": {k: r["moe_bytes_per_token_layer"] for k, r in runs.items()},
            "sent_bytes": {k: r["sent_bytes"] for k, r in runs.items()},
            "expert_load_max_over_mean": runs["dp"]["expert_load_max_over_mean"],
            "model_cpu_s_per_token": {k: r["model_cpu_seconds"] / r["generated_tokens"] for k, r in runs.items()},
            "redundant_work_ratio": (runs["tp"]["model_cpu_seconds"] / runs["tp"]["generated_tokens"])
            / (runs["dp"]["model_cpu_seconds"] / runs["dp"]["generated_tokens"]),
            "compute_share": {k: r["compute_share"] for k, r in runs.items()},
            "timed_steps": {k: r["timed_steps"] for k, r in runs.items()},
            "requests": args.requests, "prompt_tokens": args.prompt, "generated_per_request": args.tokens,
            "ranks": WORLD, "cpus": os.cpu_count(), "loadavg_1min": load_start, "loadavg_1min_end": os.getloadavg()[0],
        }
    text = json.dumps(figures, indent=2, sort_keys=True)
    print(text)
    if args.json:
        tmp_path = args.json.with_suffix(".tmp")
        tmp_path.write_text(text)
        tmp_path.replace(args.json)


if __name__ == "__main__":
    main()

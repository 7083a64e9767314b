"""Decode throughput of the CPU engine vs the PyTorch reference and transformers' `generate`.

Builds tiny-kimi-linear widened to hidden 512 / 32 experts (world 1, ONNX Runtime backend, pools sized by
the recipe: 8 sequences x --max-seq-len tokens) and measures, in one run on the same weights, tokens/s of
greedy decoding at batch 1 and batch 8, in interleaved rounds (each method's best round):
  - engine: `Engine.step` with N sequences packed in one step (one token each);
  - reference: `KimiModel.decode` (fp32 PyTorch, batch rows advancing together);
  - transformers: `KimiLinearForCausalLM.generate` (greedy, fp32, torch fallbacks; test extra).
Prints the ratios `engine_vs_transformers_b1` / `_b8` (goal >= 2) and `engine_vs_reference_*`.

State model (paged, in place), same model and batch (8 sequences decoding after a CONTEXT_LEN-token prompt):
  - `decode_step_ratio_pool8x`: median decode-step time with 8x the slots and cache blocks the batch needs,
    divided by the median with right-sized pools; steps interleaved between the two engines, equal counts
    (goal <= 1.2: a step costs O(tokens + context used), not O(pool));
  - `rss_per_cached_token`: growth of the process RSS per token written to the cache, on the second of two
    equal cache fills into fresh blocks (the first also warms ORT's arenas; reported as `_first_fill`),
    next to `cache_bytes_per_token` from the planner (what the pools should cost);
  - `decode_step_ratio_fp8_vs_bf16`: the same decode steps with `kv_cache: fp8` pools over bf16 pools (the
    cost of decoding fp8 rows after the gather), next to `cache_bytes_per_token_fp8`.

    python benchmarks/decode.py [--steps 32] [--rounds 3] [--max-seq-len 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import yaml
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.engine_config import EngineConfig
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.graphs.model import KimiModel
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine

PROMPT_LEN = 16
CONTEXT_LEN = 448  # prompt tokens per sequence before the pool-size decode steps (tiny-cpu max_seq_len 512)
POOL_BATCH = 8
RSS_FILL_SEQUENCES = 48  # sequences of CONTEXT_LEN tokens per cache fill of the RSS measurement


@contextlib.contextmanager
def _transformers_without_fla():
    """transformers with fla hidden so Kimi Linear binds its torch fallbacks (fla's Triton kernels need a GPU)."""
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        yield importlib.import_module("transformers")
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


BENCH_PRESET = "bench-kimi-linear-h512"


def bench_hf_config() -> dict:
    """tiny-kimi-linear widened to sizes where the matmuls, not per-op overhead, dominate a step: hidden 512,
    8 KDA / MLA heads of 64, 32 experts top-4 of width 256, vocabulary 512 (the byte tokenizer's)."""
    from moe_export.export.convert.synth import preset_hf_config

    cfg = preset_hf_config("tiny-kimi-linear")
    cfg.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=64,
               qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024, num_experts=32, num_experts_per_token=4,
               moe_intermediate_size=256)
    cfg["linear_attn_config"].update(num_heads=8, head_dim=64)
    return cfg


def build_engine(root: Path, max_seq_len: int, kv_cache: str = "bf16") -> Path:
    from moe_export.export.convert import synth

    synth.PRESETS[BENCH_PRESET] = bench_hf_config
    recipe = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    recipe.update(name=f"decode-bench-{kv_cache}", model={"source": f"synthetic:{BENCH_PRESET}"}, parallel={"tp": 1, "ep": 1})
    recipe["quantization"]["kv_cache"] = kv_cache
    recipe["target"]["gpus_per_node"] = 1
    recipe["limits"].update(max_batch=8, max_seq_len=max_seq_len, max_num_tokens=512)
    path = root / f"decode-bench-{kv_cache}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = root / f"engine-{kv_cache}"
    build(load_recipe(path)[0], out)
    return out


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * b + 13 * t) % 250 + 1 for t in range(PROMPT_LEN)] for b in range(batch)]


def engine_tps(engine: Engine, batch: int, steps: int) -> float:
    per_seq = -(-(PROMPT_LEN + steps + 1) // engine.block_size)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    for s in range(batch):
        engine.reset_slot(s)
    logits = engine.step(StepBatch.from_sequences([SequenceChunk(s, 0, p, tables[s]) for s, p in enumerate(prompts(batch))]))
    tokens = logits.argmax(-1).tolist()
    start = time.perf_counter()
    for step in range(steps):
        logits = engine.step(StepBatch.from_sequences(
            [SequenceChunk(s, PROMPT_LEN + step, [tokens[s]], tables[s]) for s in range(batch)]))
        tokens = logits.argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - start)


def context_prompt(seq: int) -> list[int]:
    return [(11 * seq + 5 * t) % 250 + 1 for t in range(CONTEXT_LEN)]


def fill(engine: Engine, first_block: int, per_seq: int, sequences: int = POOL_BATCH) -> list[list[int]]:
    """Prefill `sequences` sequences (slot s, blocks first_block + s*per_seq ..); returns their block tables."""
    tables = [list(range(first_block + s * per_seq, first_block + (s + 1) * per_seq)) for s in range(sequences)]
    for s in range(sequences):
        engine.reset_slot(s)
        engine.step(StepBatch.from_sequences([SequenceChunk(s, 0, context_prompt(s), tables[s])]))
    return tables


def median_step_ratio(base: Engine, other: Engine, steps: int) -> float:
    """Median decode-step time of `other` / of `base`: POOL_BATCH sequences after a CONTEXT_LEN-token prompt, one
    token each per step, steps interleaved between the two engines (equal counts)."""
    per_seq = -(-(CONTEXT_LEN + steps) // 64)
    assert base.block_size == other.block_size == 64
    tables = {id(e): fill(e, 0, per_seq) for e in (base, other)}
    times: dict[int, list[float]] = {id(base): [], id(other): []}
    tokens = [1] * POOL_BATCH
    for step in range(steps):
        for eng in ((base, other) if step % 2 == 0 else (other, base)):
            batch = StepBatch.from_sequences(
                [SequenceChunk(s, CONTEXT_LEN + step, [tokens[s]], tables[id(eng)][s]) for s in range(POOL_BATCH)])
            t0 = time.perf_counter()
            eng.step(batch)
            times[id(eng)].append(time.perf_counter() - t0)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return median[id(other)] / median[id(base)]


def right_sized(out: Path, steps: int, scale: int = 1) -> Engine:
    """An engine whose pools hold `scale` x what POOL_BATCH sequences of CONTEXT_LEN + steps tokens need."""
    per_seq = -(-(CONTEXT_LEN + steps) // 64)
    return Engine(out, num_slots=scale * POOL_BATCH, num_blocks=scale * POOL_BATCH * per_seq, threads=2)


def decode_step_ratio_pool8x(out: Path, steps: int) -> float:
    """Median decode-step time with 8x pools / with right-sized pools (interleaved, equal step counts)."""
    return median_step_ratio(right_sized(out, steps), right_sized(out, steps, 8), steps)


def rss_per_cached_token(out: Path) -> tuple[float, float]:
    """(second fill, first fill) RSS growth per cached token, pools sized for three fills."""
    per_seq = -(-CONTEXT_LEN // 64)
    n = RSS_FILL_SEQUENCES
    engine = Engine(out, num_slots=n, num_blocks=3 * n * per_seq, threads=2)
    proc = psutil.Process()
    growth = []
    for fill_index in range(2):
        before = proc.memory_info().rss
        fill(engine, fill_index * n * per_seq, per_seq, n)
        growth.append((proc.memory_info().rss - before) / (n * CONTEXT_LEN))
    return growth[1], growth[0]


def reference_tps(model: KimiModel, batch: int, steps: int) -> float:
    cache = model.new_cache(batch)
    with torch.no_grad():
        tokens = model.prefill(torch.tensor(prompts(batch)), cache)[:, -1].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = model.decode(tokens, cache).argmax(-1)
    return batch * steps / (time.perf_counter() - start)


def load_transformers(checkpoint: Path):
    with _transformers_without_fla() as transformers:
        return transformers.KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def transformers_tps(model, batch: int, steps: int) -> float:
    ids = torch.tensor(prompts(batch))
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kwargs)
        total = time.perf_counter() - t0
    return batch * steps / max(total - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each method keeps its best")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="recipe limit: sizes the engine's pools")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds, args.max_seq_len = 2, 1, 1024
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        out = build_engine(Path(tmp), args.max_seq_len)
        checkpoint = next((out / ".cache").glob("source-*"))
        engine = Engine(out, threads=2)  # pools as the recipe sizes them: max_batch x max_seq_len tokens
        model = load_model(checkpoint)
        hf = load_transformers(checkpoint)
        methods = {"engine": lambda b: engine_tps(engine, b, args.steps),
                   "reference": lambda b: reference_tps(model, b, args.steps),
                   "transformers": lambda b: transformers_tps(hf, b, args.steps)}
        figures: dict[str, float] = {"rounds": args.rounds, "max_seq_len": args.max_seq_len,
                                     "pool_tokens": engine.num_blocks * engine.block_size}
        for _ in range(args.rounds):  # one call of every method per round, same count for all
            for batch in (1, 8):
                for name, tps in methods.items():
                    key = f"{name}_tokens_per_s_b{batch}"
                    figures[key] = max(figures.get(key, 0.0), tps(batch))
        for batch in (1, 8):
            figures[f"engine_vs_transformers_b{batch}"] = (
                figures[f"engine_tokens_per_s_b{batch}"] / figures[f"transformers_tokens_per_s_b{batch}"]
            )
            figures[f"engine_vs_reference_b{batch}"] = (
                figures[f"engine_tokens_per_s_b{batch}"] / figures[f"reference_tokens_per_s_b{batch}"]
            )
        from moe_export.export.plan.planner import engine_pool_sizes

        figures["decode_step_ratio_pool8x"] = decode_step_ratio_pool8x(out, args.steps)
        figures["rss_per_cached_token"], figures["rss_per_cached_token_first_fill"] = rss_per_cached_token(out)
        figures["cache_bytes_per_token"] = engine_pool_sizes(engine.config.recipe, engine.config.model).bytes_per_token
        fp8 = build_engine(Path(tmp), args.max_seq_len, "fp8")
        fp8_cfg = EngineConfig.read(fp8)
        figures["decode_step_ratio_fp8_vs_bf16"] = median_step_ratio(right_sized(out, args.steps),
                                                                     right_sized(fp8, args.steps), args.steps)
        figures["cache_bytes_per_token_fp8"] = engine_pool_sizes(fp8_cfg.recipe, fp8_cfg.model).bytes_per_token
    for key, value in figures.items():
        print(f"{key:36s} {value:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()

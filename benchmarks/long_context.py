"""Long contexts on the CPU runner: prefill time, peak RSS, decode ms per token and host ms per step at each context.

    python benchmarks/long_context.py [--contexts 4096,16384,65536,262144] [--presets tiny-k3-dsa,tiny-k3]
        [--million] [--baseline CHECKOUT --baseline-contexts 65536] [--decode-steps 8] [--work DIR] [--json PATH]
    python benchmarks/long_context.py --smoke          # tiny sizes, seconds (a default-suite test runs it)

Engines: `synthetic:PRESET` (the `moe-export synth` checkpoint) built by `moe-export build`'s code path from
tiny-cpu.yaml with world 1 (tp 1, ep 1), backend onnxruntime, max_batch 1, max_num_tokens 512 and max_seq_len
262,144 + 1,024 (1,048,576, the schema's most, with --million), bf16 cache pools; built once into --work and
reused.

Each point runs in a fresh process (its RSS is that point's alone) through the engine core's `Scheduler` as `serve`
uses it (prefix caching and kept sessions on, no overlap), one request: a CONTEXT-token prompt, then
--decode-steps tokens decoded with a repetition / presence / frequency penalty set (ignore_eos):
  - `prefill_s`: wall time until the prompt is consumed (its first token sampled);
  - `prefill_steps` and `short_prefill_steps`: steps of the prompt, and those before the last with fewer than
    max_num_tokens tokens, but for the one ending at the prompt's last block boundary (a prefix-cache checkpoint
    target: a chunk ends there so that a continuing prompt resumes from it; without prefix caching there is none);
  - `peak_rss_mb`: the process's peak RSS minus its RSS after loading the engine (pools of the point's blocks only);
  - `decode_ms_per_token`: mean wall time of a decode step (one token);
  - `host_ms_per_step`: of each decode step, the time outside the runner's `sample` (scheduling, sampling rows,
    output processing), mean;
  - `prefill_cpu_s`, `decode_cpu_ms_per_token`, `host_cpu_ms_per_step`: the same in this process's CPU time (all its
    threads; `time.process_time`), which a machine shared with other work inflates less than wall time.
Ratios printed, the largest context over the smallest: `host_ms_{preset}_262144_over_4096` (goal <= 1.2, penalties
on), `decode_{preset}_262144_over_4096` (tiny-k3-dsa: goal <= 3), and their CPU-time forms (`host_cpu_ms_...`,
`decode_cpu_...`).

--baseline CHECKOUT: the same points on another checkout of the project (e.g. today's main: `git worktree add
/tmp/base 6e8e8bb`), imported from there (a `moe_export` link to it first on PYTHONPATH, this venv's packages),
its engine built by its own code, alternated with this checkout's point by point in the same minutes;
`prefill_speedup_{preset}_{context}` = baseline prefill_s / ours (goal at tiny-k3-dsa 64k: >= 10).

--million: a 1M point per preset (MILLION = 1,048,512 tokens: one block below max_seq_len 1,048,576): the prompt's
prefill run for at most --million-prefill-s seconds (tokens reached and tokens/s reported), and decode steps on a
MILLION-token cache filled without prefilling it: a MILLION_SEED-token prompt is prefilled, then its cache rows (MLA
latent and indexer keys, every pool) are copied block by block over positions MILLION_SEED .. MILLION - 1 (a tiled
copy of real rows; the KDA state is the one after the seed prompt), and `Engine.step` decodes at position MILLION
(`decode_ms_per_token_1m`, the mean of the steps after the first).

Also, quick and free of prefill time: `decode_ms_per_token_tiled_cache` [mean wall, mean CPU, least round's CPU] ms
at each context (the --million method: a tiled copy of a MILLION_SEED-token prefill's cache up to the largest
context, `Engine.step` alone, rounds of decode steps alternated over the contexts in one process; ratios
`decode_tiled_...`, `decode_cpu_tiled_...` and, load-robust, `decode_cpu_least_tiled_...`), and `host_instant`: host ms per decode step
of the engine core over a model-free runner at each context (K3's vocabulary, a prompt drawn from all of it,
penalties, prefix caching and kept sessions on; one process, rounds of steps alternated over the contexts: the mean
and, load-robust, the least round's CPU time; `host_ms_per_step_instant_{hi}_over_{lo}` and its CPU forms, goal
<= 1.2).

`prefill_profile` and `decode_profile` (per preset with an indexer, each context): the lightning indexer's share of
one full prefill step (max_num_tokens tokens) and of one decode step at that context, and its FLOP rate, beside the
rest of the step (every other term), wall and CPU ms (`run_step_profiles`: the step through `Engine.step` on a tiled
cache, and again with the indexer's function replaced by one reading no key; the function also timed alone at the
same shapes); `growth_{hi}_over_{lo}`: each over the smallest context. At a fixed step size a term growing with the
context grows the prefill with its square: the indexer should be the only one (`rest` flat).

`loadavg` is read before and after; numbers taken while other work loads the machine are not evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("tiny-k3-dsa", "tiny-k3")
CONTEXTS = (4096, 16384, 65536, 262144)
MAX_NUM_TOKENS = 512
MILLION = (1 << 20) - 64  # the 1M point's cache: one block short of max_seq_len 1,048,576, room to decode
MILLION_SEED = 4096
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def build_engine(work: Path, preset: str, max_seq_len: int) -> Path:
    """The engine of `preset` for this benchmark, built under `work` (what is there and current is reused)."""
    import yaml
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    data["name"] = f"long-{preset}-{max_seq_len}"
    data["model"] = {"source": f"synthetic:{preset}"}
    data["target"].update(gpus_per_node=1, memory_gib=8)
    data["parallel"] = {"tp": 1, "ep": 1}
    data["limits"].update(max_batch=1, max_seq_len=max_seq_len, max_num_tokens=MAX_NUM_TOKENS)
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe, _ = load_recipe(path)
    out = work / recipe.name
    build(recipe, out)  # content-addressed: reruns only the stages whose inputs or code changed
    return out


def status_bytes(key: str) -> int:
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def prompt_ids(n: int, vocab: int) -> list[int]:
    """A deterministic prompt of n ordinary token ids (no special tokens: ids below 256)."""
    return [(i * 7919 + 13) % min(256, vocab) for i in range(n)]


def engine_core(runner, **kwargs):
    """The engine core stepping `runner` (`EngineCore`; in a checkout from before it, as `--baseline` may import,
    the `Scheduler` that ran its own steps) and the scheduler it holds."""
    try:
        from moe_export.runtime.core.engine_core import EngineCore
    except ImportError:  # the baseline's engine core
        from moe_export.runtime.core.scheduler import Scheduler

        core = Scheduler(runner, **kwargs)
        return core, core
    core = EngineCore(runner, **kwargs)
    return core, core.scheduler


def run_point(engine_dir: Path, context: int, decode_steps: int, prefill_limit_s: float | None) -> dict:
    """One point in this process (see the module doc); prefill_limit_s: stop the prefill after that long."""
    from moe_export.common.engine_config import EngineConfig
    from moe_export.runtime.core.scheduler import Request
    from moe_export.runtime.engine.ort import Engine
    from moe_export.runtime.sampling import SamplingParams

    blocks = -(-(context + decode_steps + 1) // EngineConfig.read(engine_dir).limits.block_size) + 1
    eng = Engine(engine_dir, num_slots=1, num_blocks=blocks)
    vocab = int(eng.model_config.get("vocab_size") or eng.model_config.get("text_config", {}).get("vocab_size"))
    inside: list[float] = []  # wall s in the runner's `sample`, per step
    inside_cpu: list[float] = []  # this process's CPU s (all threads) in it
    tokens: list[int] = []
    sample = eng.sample

    def timed_sample(batch, sampling):
        t0, c0 = time.perf_counter(), time.process_time()
        out = sample(batch, sampling)
        inside.append(time.perf_counter() - t0)
        inside_cpu.append(time.process_time() - c0)
        tokens.append(0 if batch is None else int(batch.input_ids.shape[0]))
        return out

    eng.sample = timed_sample
    sched, _ = engine_core(eng, keep_sessions=True, prefix_caching=True)
    warm = SamplingParams(max_tokens=2, ignore_eos=True, **PENALTIES)
    sched.add(Request("warm-up", prompt_ids(64, vocab)[::-1], warm))  # shares no block with the long prompt
    while sched.has_work:
        sched.step()
    inside.clear()
    inside_cpu.clear()
    tokens.clear()
    Path("/proc/self/clear_refs").write_text("5")  # peak (VmHWM) from here
    base_rss = status_bytes("VmRSS")
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, **PENALTIES)
    sched.add(Request("long", prompt_ids(context, vocab), params))
    walls: list[float] = []
    cpus: list[float] = []
    t_start = time.perf_counter()
    prefill_s = None
    while sched.has_work:
        t0, c0 = time.perf_counter(), time.process_time()
        updates = sched.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if prefill_s is None and any(u.token_ids for u in updates):
            prefill_s = time.perf_counter() - t_start
        if prefill_s is None and prefill_limit_s is not None and time.perf_counter() - t_start > prefill_limit_s:
            break
    n_prefill = len(walls) if prefill_s is None else next(i for i, _ in enumerate(walls) if sum(tokens[:i + 1]) >= context) + 1
    prefill_tokens = tokens[:n_prefill]
    decode = list(range(n_prefill, len(walls)))
    ends = [sum(prefill_tokens[:i + 1]) for i in range(len(prefill_tokens))]
    checkpoint = (context - 1) // eng.block_size * eng.block_size  # the prompt's last block boundary
    out = {
        "context": context,
        "prefill_s": None if prefill_s is None else round(prefill_s, 3),
        "prefill_cpu_s": round(sum(cpus[:n_prefill]), 3),
        "prefilled_tokens": sum(prefill_tokens),
        "prefill_tokens_per_s": round(sum(prefill_tokens) / max(sum(walls[:n_prefill]), 1e-9), 1),
        "prefill_steps": len(prefill_tokens),
        "short_prefill_steps": sum(1 for n, end in zip(prefill_tokens[:-1], ends[:-1])
                                   if n < eng.max_num_tokens and end != checkpoint),
        "prefill_step_tokens_first_last": prefill_tokens[:3] + ["..."] + prefill_tokens[-3:]
        if len(prefill_tokens) > 6 else prefill_tokens,
        "peak_rss_mb": round((status_bytes("VmHWM") - base_rss) / 1e6, 1),
        "rss_after_load_mb": round(base_rss / 1e6, 1),
    }
    if decode:
        out["decode_ms_per_token"] = round(1e3 * sum(walls[i] for i in decode) / len(decode), 3)
        out["host_ms_per_step"] = round(1e3 * sum(walls[i] - inside[i] for i in decode) / len(decode), 3)
        out["decode_cpu_ms_per_token"] = round(1e3 * sum(cpus[i] for i in decode) / len(decode), 3)
        out["host_cpu_ms_per_step"] = round(1e3 * sum(cpus[i] - inside_cpu[i] for i in decode) / len(decode), 3)
    return out


def tiled_engine(engine_dir: Path, context: int, spare: int):
    """(engine, its block table, the seed prompt, seed prefill s, fill s): an engine whose cache holds a MILLION_SEED-
    token prefill's rows tiled block by block over positions MILLION_SEED .. `context` - 1 (every paged pool: MLA
    latents and indexer keys; the KDA state is the one after the seed), with blocks for `spare` more positions."""
    from moe_export.common.engine_config import EngineConfig
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
    from moe_export.runtime.engine.ort import Engine

    bs = EngineConfig.read(engine_dir).limits.block_size
    blocks = -(-(context + spare + 1) // bs) + 1
    eng = Engine(engine_dir, num_slots=1, num_blocks=blocks)
    table = list(range(blocks))
    vocab = int(eng.model_config.get("vocab_size") or eng.model_config.get("text_config", {}).get("vocab_size"))
    seed = prompt_ids(min(MILLION_SEED, context), vocab)
    eng.reset_slot(0)
    t0 = time.perf_counter()
    for start in range(0, len(seed), eng.max_num_tokens):
        chunk = seed[start:start + eng.max_num_tokens]
        need = -(-(start + len(chunk)) // bs)
        eng.step(StepBatch.from_sequences([SequenceChunk(0, start, chunk, table[:need])], eng.image_width))
    seed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    seed_blocks = len(seed) // bs
    for runner in eng.ranks:
        for pool in runner.pools.values():
            if pool.ndim == 3 and pool.shape[0] == blocks:  # a paged cache pool [NB, BS, D]
                for b in range(seed_blocks, context // bs, max(seed_blocks, 1)):
                    n = min(seed_blocks, context // bs - b)
                    pool[b:b + n] = pool[:n]
    return eng, table, seed, seed_s, time.perf_counter() - t0


def decode_steps_at(eng, table: list[int], token: int, positions) -> tuple[list[float], list[float], int]:
    """`Engine.step` decoding one token at each of `positions` (greedy): wall and CPU s of each, the last token."""
    import numpy as np
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch

    bs, times, cpu = eng.block_size, [], []
    for pos in positions:
        batch = StepBatch.from_sequences([SequenceChunk(0, pos, [token], table[:pos // bs + 1])], eng.image_width)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = eng.step(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        token = int(np.argmax(logits[-1]))
    return times, cpu, token


def run_million_decode(engine_dir: Path, decode_steps: int, context: int = MILLION) -> dict:
    """Decode steps at position `context` on a cache filled by tiling a MILLION_SEED-token prefill's rows."""
    eng, table, seed, seed_s, fill_s = tiled_engine(engine_dir, context, decode_steps)
    times, cpu, _ = decode_steps_at(eng, table, seed[-1], range(context, context + decode_steps))
    return {"seed_prefill_s": round(seed_s, 2), "cache_fill_s": round(fill_s, 2),
            "decode_ms_per_token_1m": round(1e3 * sum(times[1:] or times) / len(times[1:] or times), 2),
            "decode_cpu_ms_per_token_1m": round(1e3 * sum(cpu[1:] or cpu) / len(cpu[1:] or cpu), 2),
            "cache_filled_by": f"{len(seed)}-token prefill's cache rows tiled over positions "
                               f"{len(seed)}..{context - 1}; KDA state after the {len(seed)} tokens"}


def run_tiled_decodes(engine_dir: Path, contexts: list[int], steps: int, rounds: int = 8) -> dict:
    """Decode ms per token at each context on one tiled cache (`tiled_engine` up to the largest): `rounds` rounds of
    `steps` steps at each context in turn (positions context, context + 1, ...; a step at position p reads the
    keys before p alone), so a load on the machine falls on every context alike. {context: [mean wall, mean CPU,
    least round's CPU]} ms (the first round is a warm-up, and the first step of each round, not counted)."""
    eng, table, seed, _, _ = tiled_engine(engine_dir, max(contexts), (rounds + 1) * (steps + 1))
    token, done = seed[-1], {c: 0 for c in contexts}
    wall: dict[int, list[float]] = {c: [] for c in contexts}
    cpu: dict[int, list[float]] = {c: [] for c in contexts}
    for r in range(rounds + 1):
        for c in contexts:  # steps + 1 steps, the first not counted: it follows another context's (cold caches)
            times, cpus, token = decode_steps_at(eng, table, token, range(c + done[c], c + done[c] + steps + 1))
            done[c] += steps + 1
            if r:
                wall[c].append(sum(times[1:]) / steps)
                cpu[c].append(sum(cpus[1:]) / steps)
    return {str(c): [round(1e3 * sum(wall[c]) / rounds, 2), round(1e3 * sum(cpu[c]) / rounds, 2),
                     round(1e3 * min(cpu[c]), 2)] for c in contexts}


def indexer_session(runner, rank_dir: Path, segment: str):
    """(an ONNX Runtime session of one DSAIndexer node with the segment's own function body, the engine session's
    options and the node's topk; the name of the key pool its first indexer reads; how many indexer layers the
    segment has), or (None, None, 0) without one."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    model = onnx.load(str(rank_dir / segment), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "DSAIndexer"]
    if not nodes:
        return None, None, 0
    function = next(f for f in model.functions if f.name == "DSAIndexer")
    node = helper.make_node("DSAIndexer", ["q_idx", "weights", "k_pool", "k_new", "cu_seqlens", "block_tables",
                                           "positions"], ["indices"], domain=function.domain,
                            topk=next(a.i for a in nodes[0].attribute if a.name == "topk"))
    graph_inputs = {vi.name: vi for vi in model.graph.input}
    pool = nodes[0].input[2]
    inputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("q_idx", "weights")]
    inputs += [helper.make_value_info("k_pool", graph_inputs[pool].type),
               helper.make_tensor_value_info("k_new", onnx.TensorProto.FLOAT, None)]
    inputs += [graph_inputs[name] for name in ("cu_seqlens", "block_tables", "positions")]
    graph = helper.make_graph([node], "indexer", inputs,
                              [helper.make_tensor_value_info("indices", onnx.TensorProto.INT64, None)])
    one = helper.make_model(graph, opset_imports=list(model.opset_import), functions=[function])
    sess = ort.InferenceSession(one.SerializeToString(), runner.sessions[segment].get_session_options(),
                                providers=["CPUExecutionProvider"])
    return sess, pool, len(nodes)


def without_indexer(model) -> bool:
    """Replaces `model`'s DSAIndexer function by one that reads no key and selects nothing (indices [T, topk] of
    -1: the sparse attention after it gathers and masks its topk rows as before); False if it has none."""
    from onnx import AttributeProto, TensorProto, helper

    for function in model.functions:
        if function.name == "DSAIndexer":
            topk = helper.make_node("Constant", [], ["topk"])
            topk.attribute.append(AttributeProto(name="value_int", ref_attr_name="topk", type=AttributeProto.INT))
            nodes = [topk,
                     helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [0])),
                     helper.make_node("Unsqueeze", ["topk", "axes"], ["k"]),
                     helper.make_node("Shape", ["q_idx"], ["t"], start=0, end=1),
                     helper.make_node("Concat", ["t", "k"], ["shape"], axis=0),
                     helper.make_node("Constant", [], ["none"], value=helper.make_tensor("n", TensorProto.INT64, [], [-1])),
                     helper.make_node("Expand", ["none", "shape"], ["indices"])]
            del function.node[:]
            function.node.extend(nodes)
            return True
    return False


def run_step_profiles(engine_dir: Path, contexts: list[int], rounds: dict[str, int] | None = None) -> dict:
    """{"prefill": ..., "decode": ...} by context (empty without an indexer): the lightning indexer's share of a full
    prefill step (Tn = max_num_tokens tokens) and of a decode step (Tn = 1): one step of Tn tokens at position
    `context` of a tiled cache (`tiled_engine` up to the largest context) through `Engine.step` (`step`); the same
    step with the DSAIndexer function replaced by one that reads no key (`without_indexer`; the engine's sessions
    re-made from that graph with their own options): `rest`, every other term (projections, KDA scan, sparse MLA
    attention, MoE, head); `indexer` = step - rest; and `indexer_alone`: the engine's DSAIndexer function timed
    alone at the same shapes (`indexer_session`: one node, its own body, session options and topk, the engine's key
    pool, Tn random queries, the step's block table and positions; warm caches) times the number of indexer layers.
    Wall and CPU ms (this process, all threads), each the least of `rounds[kind]` rounds (default 5 prefill, 30
    decode; one more before them not counted), the three alternated. The indexer's FLOPs in the step: layers x Hi x
    (2 Di + 2) x pairs, pairs = Tn x context + Tn (Tn + 1) / 2 (token, attended position) pairs (2 Di for q . k, 2
    for the head-weighted relu sum); its rate: those FLOPs over its time in the step and alone. At a fixed step size
    a term whose time grows with the context makes the prefill's total grow with the square of the context: `rest`
    staying flat from context to context while the indexer grows shows it is the only such term."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
    from moe_export.runtime.engine.ranks import rank_folders

    rank_dir = rank_folders(engine_dir)[0]
    if not any(n.op_type == "DSAIndexer" for f in rank_dir.glob("*.onnx")
               for n in onnx.load(str(f), load_external_data=False).graph.node):
        return {"prefill": {}, "decode": {}}
    eng, table, seed, _, _ = tiled_engine(engine_dir, max(contexts), MAX_NUM_TOKENS)
    runner = eng.ranks[0]
    full, ablated = dict(runner.sessions), dict(runner.sessions)
    for segment, sess in full.items():
        model = onnx.load(str(rank_dir / segment), load_external_data=False)
        if without_indexer(model):
            alone, pool, layers = indexer_session(runner, rank_dir, segment)
            opts = sess.get_session_options()  # the graph read from bytes: its external data from the rank folder
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(rank_dir))
            ablated[segment] = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    text = eng.model_config.get("text_config", eng.model_config)
    heads, dim = int(text["index_n_heads"]), int(text["index_head_dim"])
    rounds = {"prefill": 5, "decode": 30, **(rounds or {})}
    rng = np.random.default_rng(0)
    out: dict = {"prefill": {}, "decode": {}}
    for kind, context in ((k, c) for k in out for c in contexts):
        n = eng.max_num_tokens if kind == "prefill" else 1
        chunk = [seed[(context + i) % len(seed)] for i in range(n)]
        blocks = table[:-(-(context + n) // eng.block_size)]
        batch = StepBatch.from_sequences([SequenceChunk(0, context, chunk, blocks)], eng.image_width)
        feed = {k: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v) for k, v in {
            "q_idx": rng.standard_normal((n, heads, dim), dtype=np.float32),
            "weights": rng.random((n, heads), dtype=np.float32), "k_pool": runner.pool_feeds[pool],
            "k_new": rng.standard_normal((n, dim), dtype=np.float32), "cu_seqlens": np.array([0, n], dtype=np.int64),
            "block_tables": np.array([blocks], dtype=np.int64),
            "positions": np.arange(context, context + n, dtype=np.int64)}.items()}
        times: dict[str, list[tuple[float, float]]] = {"step": [], "rest": [], "indexer_alone": []}  # (wall, CPU) s
        for r in range(rounds[kind] + 1):  # the first round warms up, not counted
            for name in times:
                runner.sessions.update(ablated if name == "rest" else full)
                t0, c0 = time.perf_counter(), time.process_time()
                if name == "indexer_alone":
                    alone.run_with_ort_values(["indices"], feed)
                else:
                    eng.step(batch)
                if r:
                    times[name].append((time.perf_counter() - t0, time.process_time() - c0))
        runner.sessions.update(full)
        flops = layers * heads * (2 * dim + 2) * (n * context + n * (n + 1) // 2)
        point = {"step_tokens": n, "indexer_layers": layers, "indexer_gflop": round(flops / 1e9, 3)}
        for i, unit in enumerate(("", "_cpu")):
            step, rest = (min(t[i] for t in times[name]) for name in ("step", "rest"))
            by_itself = layers * min(t[i] for t in times["indexer_alone"])
            point.update({f"step{unit}_ms": round(1e3 * step, 2), f"rest{unit}_ms": round(1e3 * rest, 2),
                          f"indexer{unit}_ms": round(1e3 * (step - rest), 2),
                          f"indexer{unit}_share": round((step - rest) / step, 3),
                          f"indexer{unit}_gflop_per_s": round(flops / 1e9 / max(step - rest, 1e-9), 2),
                          f"indexer_alone{unit}_ms": round(1e3 * by_itself, 2),
                          f"indexer_alone{unit}_gflop_per_s": round(flops / 1e9 / by_itself, 2)})
        out[kind][str(context)] = point
    return out


class InstantRunner:
    """A model-free runner (`ModelRunner`'s fields; no pools): every step samples token 7 at once, so a scheduler
    over it costs its host work alone."""

    def __init__(self, max_seq_len: int, vocab: int) -> None:
        self.num_slots, self.block_size, self.max_seq_len = 1, 64, max_seq_len
        self.num_blocks = -(-max_seq_len // self.block_size) + 1
        self.max_num_tokens, self.max_step_pairs = MAX_NUM_TOKENS, None
        self.num_checkpoints, self.checkpoint_interval = 4, MAX_NUM_TOKENS
        self.world_size, self.comm, self.is_root, self.vision = 1, None, True, None
        self.config, self.model_config = None, {"vocab_size": vocab}

    def reset_slot(self, slot: int) -> None:
        pass

    def save_state(self, slot: int, checkpoint: int) -> None:
        pass

    def restore_state(self, slot: int, checkpoint: int) -> None:
        pass

    def sample(self, batch, sampling):
        import numpy as np
        from moe_export.runtime.engine.sampler import SampledTokens

        n = 0 if sampling is None else int(sampling.rows.shape[0])
        return SampledTokens(np.full(n, 7), [None] * n, [None] * n)


def run_host_points(contexts: list[int], steps: int = 50, rounds: int = 20, vocab: int = 163_840) -> dict:
    """Host ms per decode step of the engine core over `InstantRunner` (K3's vocabulary, a prompt of `context` ids
    drawn from all of it, penalties on, prefix caching and kept sessions on): the scheduler's, the sampling rows'
    and the step packing's work at each context, free of model time. One engine core per context in this one
    process, `rounds` rounds of `steps` steps alternated over the contexts, so a load on the machine falls on every
    context alike; the mean and the least round of each (the least is the load-robust figure)."""
    import numpy as np
    from moe_export.runtime.core.scheduler import Request
    from moe_export.runtime.sampling import SamplingParams

    cores = {}
    for context in contexts:
        sched, scheduler = engine_core(InstantRunner(context + steps * rounds + 16, vocab), keep_sessions=True,
                                       prefix_caching=True)
        prompt = np.random.default_rng(0).integers(0, vocab - 1024, context).tolist()
        sched.add(Request("long", prompt, SamplingParams(max_tokens=steps * rounds + 8, ignore_eos=True, **PENALTIES)))
        while not scheduler.running or scheduler.running[0].num_computed < context:
            sched.step()
        for _ in range(3):
            sched.step()
        cores[context] = sched
    wall: dict[int, list[float]] = {c: [] for c in contexts}
    cpu: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in range(rounds):
        for context, sched in cores.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                sched.step()
            wall[context].append(1e3 * (time.perf_counter() - t0) / steps)
            cpu[context].append(1e3 * (time.process_time() - c0) / steps)
    return {str(c): {"host_ms_per_step_instant": round(sum(wall[c]) / rounds, 4),
                     "host_cpu_ms_per_step_instant": round(sum(cpu[c]) / rounds, 4),
                     "host_cpu_ms_per_step_instant_least": round(min(cpu[c]), 4)} for c in contexts}


def point_process(python_path: str | None, *args: str, timeout: float) -> dict:
    """This script's `--point ...` in a fresh process (python_path: a checkout to import moe_export from)."""
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def shim_for(checkout: Path, work: Path) -> str:
    """A folder holding `moe_export` -> checkout (first on PYTHONPATH: imported instead of this one)."""
    shim = work / "baseline-shim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "moe_export"
    if not link.exists():
        link.symlink_to(checkout.resolve(), target_is_directory=True)
    return str(shim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--million", action="store_true")
    ap.add_argument("--million-prefill-s", type=float, default=300.0)
    ap.add_argument("--baseline", type=Path, help="another checkout of the project (today's main) to compare with")
    ap.add_argument("--baseline-contexts", default="65536")
    ap.add_argument("--work", type=Path, help="where engines are built (reused); default: a temporary folder")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="contexts 512 and 2,048, 2 decode steps, one preset")
    ap.add_argument("--point", nargs=4, metavar=("PRESET", "MAX_SEQ_LEN", "CONTEXT", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--prefill-limit-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--million-decode", nargs=2, metavar=("PRESET", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--tiled-decode", nargs=3, metavar=("PRESET", "MAX_SEQ_LEN", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--step-profiles", nargs=3, metavar=("PRESET", "MAX_SEQ_LEN", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--host-points", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.point:  # one point, in its own process
        preset, max_seq_len, context, work = args.point
        engine = build_engine(Path(work), preset, int(max_seq_len))
        print(json.dumps(run_point(engine, int(context), args.decode_steps, args.prefill_limit_s)))
        return
    if args.host_points:
        print(json.dumps(run_host_points([int(c) for c in args.host_points.split(",")])))
        return
    if args.tiled_decode:
        preset, max_seq_len, work = args.tiled_decode
        engine = build_engine(Path(work), preset, int(max_seq_len))
        contexts = [int(c) for c in args.contexts.split(",")]
        print(json.dumps(run_tiled_decodes(engine, contexts, args.decode_steps)))
        return
    if args.step_profiles:
        preset, max_seq_len, work = args.step_profiles
        engine = build_engine(Path(work), preset, int(max_seq_len))
        print(json.dumps(run_step_profiles(engine, [int(c) for c in args.contexts.split(",")])))
        return
    if args.million_decode:
        preset, work = args.million_decode
        print(json.dumps(run_million_decode(build_engine(Path(work), preset, 1 << 20), args.decode_steps)))
        return

    contexts = [512, 2048] if args.smoke else [int(c) for c in args.contexts.split(",")]
    presets = ["tiny-k3-dsa"] if args.smoke else args.presets.split(",")
    decode_steps = 2 if args.smoke else args.decode_steps
    max_seq_len = 1 << 20 if args.million else max(max(contexts) + 1024, 262144 if not args.smoke else 4096)
    baseline_contexts = [int(c) for c in args.baseline_contexts.split(",")] if args.baseline else []
    report: dict = {"smoke": args.smoke, "loadavg_before": loadavg(), "cpus": os.cpu_count(), "max_num_tokens": MAX_NUM_TOKENS,
                    "max_seq_len": max_seq_len, "points": {}, "ratios": {}, "prefill_profile": {},
                    "decode_profile": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base_work = work / "baseline"
        shim = shim_for(args.baseline, base_work) if args.baseline else None
        for preset in presets:
            build_engine(work, preset, max_seq_len)
            pts = report["points"][preset] = {}
            for context in contexts:
                common = ["--decode-steps", str(decode_steps)]
                pts[str(context)] = point_process(None, "--point", preset, str(max_seq_len), str(context), str(work),
                                                  *common, timeout=6 * 3600)
                print(preset, context, json.dumps(pts[str(context)]), flush=True)
                if context in baseline_contexts:  # alternated with ours, point by point
                    base = point_process(shim, "--point", preset, str(max_seq_len), str(context), str(base_work),
                                         *common, timeout=6 * 3600)
                    pts[f"{context}_baseline"] = base
                    print(preset, context, "baseline", json.dumps(base), flush=True)
                    if base.get("prefill_s") and pts[str(context)].get("prefill_s"):
                        report["ratios"][f"prefill_speedup_{preset}_{context}"] = round(
                            base["prefill_s"] / pts[str(context)]["prefill_s"], 2)
                        report["ratios"][f"prefill_cpu_speedup_{preset}_{context}"] = round(
                            base["prefill_cpu_s"] / pts[str(context)]["prefill_cpu_s"], 2)
            if args.million:
                pts[str(MILLION)] = {
                    **point_process(None, "--point", preset, str(max_seq_len), str(MILLION), str(work),
                                    "--decode-steps", "0", "--prefill-limit-s", str(args.million_prefill_s),
                                    timeout=args.million_prefill_s + 3600),
                    **point_process(None, "--million-decode", preset, str(work), "--decode-steps", "3",
                                    timeout=6 * 3600)}
                print(preset, MILLION, json.dumps(pts[str(MILLION)]), flush=True)
            tiled = point_process(None, "--tiled-decode", preset, str(max_seq_len), str(work), "--contexts",
                                  ",".join(map(str, contexts)), "--decode-steps", "4", timeout=3600)
            for context in contexts:  # [wall, CPU] ms
                pts[str(context)]["decode_ms_per_token_tiled_cache"] = tiled.get(str(context))
            lo, hi = str(min(contexts)), str(max(contexts))
            profiles = point_process(None, "--step-profiles", preset, str(max_seq_len), str(work), "--contexts",
                                     ",".join(map(str, contexts)), timeout=3600)
            for kind in ("prefill", "decode"):
                profile = report[f"{kind}_profile"][preset] = profiles.get(kind, profiles)
                if profile.get(lo, {}).get("indexer_ms") and profile.get(hi, {}).get("indexer_ms"):  # each term's growth
                    profile[f"growth_{hi}_over_{lo}"] = {f"{t}{unit}_ms": round(
                        profile[hi][f"{t}{unit}_ms"] / profile[lo][f"{t}{unit}_ms"], 2)
                        for t in ("step", "indexer", "rest", "indexer_alone") for unit in ("", "_cpu")}
                print(preset, kind, "profile", json.dumps(profile), flush=True)
            if tiled.get(lo) and tiled.get(hi):
                report["ratios"][f"decode_tiled_{preset}_{hi}_over_{lo}"] = round(tiled[hi][0] / tiled[lo][0], 2)
                report["ratios"][f"decode_cpu_tiled_{preset}_{hi}_over_{lo}"] = round(tiled[hi][1] / tiled[lo][1], 2)
                report["ratios"][f"decode_cpu_least_tiled_{preset}_{hi}_over_{lo}"] = round(tiled[hi][2] / tiled[lo][2], 2)
            lo, hi = str(min(contexts)), str(max(contexts))
            a, b = pts.get(lo, {}), pts.get(hi, {})
            for key, name in (("host_ms_per_step", "host_ms"), ("host_cpu_ms_per_step", "host_cpu_ms"),
                              ("decode_ms_per_token", "decode"), ("decode_cpu_ms_per_token", "decode_cpu")):
                if a.get(key) and b.get(key):
                    report["ratios"][f"{name}_{preset}_{hi}_over_{lo}"] = round(b[key] / a[key], 2)
        report["host_instant"] = point_process(None, "--host-points", ",".join(map(str, contexts)), timeout=3600)
        a, b = report["host_instant"][str(min(contexts))], report["host_instant"][str(max(contexts))]
        for key in ("host_ms_per_step_instant", "host_cpu_ms_per_step_instant", "host_cpu_ms_per_step_instant_least"):
            if a.get(key) and b.get(key):
                report["ratios"][f"{key}_{max(contexts)}_over_{min(contexts)}"] = round(b[key] / a[key], 2)
    report["loadavg_after"] = loadavg()
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

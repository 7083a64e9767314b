"""The torch backend end to end on one GPU (device commands 2 and 3, `gpu_torch_check.sh`), against the fp32
PyTorch reference on the source checkpoint (CPU).

`--preset tiny-k3 --serve` (command 2, any lent GPU) and `--preset mid-k3 --decode-timing` (command 3, an H200:
mid-k3's recipe, `recipes/mid-k3-h200.yaml`, sizes its pools for 141 GB) each:
  - build the preset (`moe-export synth`; mid-k3 is K3 at its real widths, 3 layers, 16 experts, about 10 GB) with
    backend torch for one GPU (`<p>_build_s`), load it (`<p>_load_s`: weights, pools, kernel warm-up, CUDA graph
    capture), `LLM(engine).generate` greedily for 16 tokens (`<p>_generate_s`, `<p>_engine_tokens`) and the
    reference's greedy tokens on the same prompt (`<p>_reference_tokens`), the first divergence
    (`<p>_first_divergence`, None if none) and there the reference's gap between its top two logits and the
    engine's choice's reference logit below the top (`<p>_near_tie`: a divergence at a gap under `NEAR_TIE`, which
    bf16 rounding can flip); `<p>` is the preset with `_` for `-`;
  - `--serve`: `moe-export serve` of the engine answering the official `openai` client's chat completion
    (`serve` "ok", `serve_finish_reason`, `serve_completion_tokens`; else `serve_error` with the server's last
    output);
  - `--decode-timing`: decode steps on the runtime's own path, `TorchEngine.step_logits` of the loaded engine (a
    world-1 tp step: the decode bucket's CUDA graph replayed, `mid_k3_decode_step_ms_B`, and the same step eager,
    `mid_k3_decode_step_eager_ms_B`), B = 32 sequences (the recipe's max_batch) at 8,192-token contexts, against
    the step's bandwidth bound in the same run (`mid_k3_decode_bound_ms_32`: the rank's weights but the embedding
    table read once, the B sequences' KDA state and conv windows read and written, their MLA cache rows read; over
    `read_bandwidth_gbs`, a sum over 4 GiB), `mid_k3_decode_over_bound_32`, `mid_k3_decode_tokens_per_s_32`
    (B / step time: one GPU serving B sequences of this 3-layer model), `mid_k3_cuda_graph_speedup_32` (eager /
    replayed) and one eager 8,192-token prefill chunk (`mid_k3_prefill_ms_8k`, `mid_k3_prefill_tokens_per_s_8k`).
Every stage writes the JSON (`--json PATH`) when it ends; a failed stage leaves `<stage>_error`.
`--work DIR` keeps the checkpoints and engines. `--device cpu` is the CPU tests' dry run of command 2 (tiny-k3 on
the CPU, fp32: every stage's code runs, serve included; tests/test_device_rehearsal.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]

from moe_export.export.build import build
from moe_export.export.convert.checkpoint import load_model
from moe_export.recipes.schema import load_recipe

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]
NEW_TOKENS = 16
NEAR_TIE = 0.05  # reference logit gap (fp32) under which bf16 rounding may pick the other token
DECODE_BATCH, DECODE_CONTEXT, PREFILL_CHUNK = 32, 8192, 8192
TIMED_STEPS = 5
SERVE_DEADLINE_S = 240


def one_gpu_recipe(work: Path, preset: str, device: str = "cuda") -> Path:
    """The preset on one H200 with backend torch (mid-k3: its shipped recipe); `device` cpu: on the CPU."""
    if preset == "mid-k3":
        data = yaml.safe_load(Path(load_recipe("mid-k3-h200.yaml")[1]).read_text())
    else:
        data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
        data.update(name=f"{preset}-h200-torch", model={"source": f"synthetic:{preset}"}, backend="torch",
                    target={"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "memory_gib": 141},
                    parallel={"tp": 1, "ep": 1})
        data["limits"]["max_batch"] = 8
    if device == "cpu":
        data["target"] = {"gpu": "cpu", "nodes": 1, "gpus_per_node": 1, "memory_gib": 8}
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def reference_greedy(checkpoint: Path) -> tuple[list[int], list[torch.Tensor]]:
    """The fp32 reference's greedy tokens and the logits each was chosen from (CPU)."""
    model = load_model(checkpoint)
    cache = model.new_cache(1)
    logits = model(torch.tensor([PROMPT]), cache)[0, -1]
    tokens, seen = [], []
    for _ in range(NEW_TOKENS):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model.decode(torch.tensor([tokens[-1]]), cache)[0]
    return tokens, seen


def compare(engine_tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> dict:
    out = {"first_divergence": None}
    for i, (a, b) in enumerate(zip(engine_tokens, ref_tokens)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            out.update(first_divergence=i, reference_top2_gap=float(top2[0] - top2[1]),
                       engine_choice_below_top=float(top2[0] - ref_logits[i][a]))
            out["near_tie"] = out["engine_choice_below_top"] < NEAR_TIE
            break
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve(engine: Path, log: Path) -> dict:
    """`moe-export serve` on the GPU, one chat completion through the official openai client; the server's output
    in `log`, its tail the error when it does not come up."""
    import openai

    port = free_port()
    code = ("import sys; from moe_export.runtime.entrypoints.cli import main; "
            f"sys.argv = ['moe-export', 'serve', {str(engine)!r}, '--port', '{port}']; main()")
    with log.open("wb") as out:
        server = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy(), stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + SERVE_DEADLINE_S
        while True:
            try:
                reply = client.chat.completions.create(model=engine.name, max_tokens=8,
                                                       messages=[{"role": "user", "content": "Hello"}])
                break
            except openai.APIConnectionError:
                if time.time() > deadline or server.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-6:]
                    raise RuntimeError("the server did not come up: " + " | ".join(tail)) from None
                time.sleep(2)
        return {"serve": "ok", "serve_finish_reason": reply.choices[0].finish_reason,
                "serve_completion_tokens": reply.usage.completion_tokens}
    finally:
        server.terminate()
        server.wait(30)


def decode_batch(engine, batch: int, context: int, first_block: int = 0):
    """A decode StepBatch of `batch` sequences (slots 0..B-1) at position `context`, each with its own run of
    blocks from `first_block`."""
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch

    per = context // engine.block_size + 1
    return StepBatch.from_sequences([SequenceChunk(s, context, [7], list(range(first_block + s * per,
                                                                               first_block + (s + 1) * per)))
                                     for s in range(batch)])


def timed_ms(fn, device: torch.device, iters: int = TIMED_STEPS, warmup: int = 2) -> float:
    """Median wall time of fn() in ms, the device synchronised around each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def read_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes per second of a sum over an `nbytes` bf16 tensor."""
    t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    return nbytes / (timed_ms(lambda: t.sum(), device) / 1e3)


def step_bytes(engine, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` sequences at `context` tokens must move on the engine's one rank: its weights
    but the embedding table (the lookup reads B rows), the sequences' recurrent state read and written, their MLA
    cache rows read."""
    (rank,) = engine.models
    weights = (engine.dir / f"rank{rank}" / "weights.safetensors").stat().st_size
    cfg = engine.config.model
    weights -= cfg.vocab_size * cfg.hidden_size * 2  # the bf16 embedding table
    pools = engine.pools[rank]
    state = sum(p[:batch].numel() * p.element_size() for n, p in pools.items()
                if n.startswith(("kda_state.", "conv_state.")))
    cache = sum(context * batch * p.shape[-1] * p.element_size() for n, p in pools.items() if n.startswith("mla_cache."))
    return weights + 2 * state + cache


def decode_timing(fig: Figures, engine, key: str) -> None:
    """The `--decode-timing` figures of the module docstring, on the loaded engine's own step path."""
    device = engine.device
    batch = decode_batch(engine, DECODE_BATCH, DECODE_CONTEXT)
    step = lambda: engine.step_logits(batch)  # noqa: E731
    graphs = engine.graphs
    if graphs is None or not graphs.covers(batch):
        raise RuntimeError("the engine has no decode CUDA graph for this step (not the runtime's decode path)")
    fig[f"{key}_decode_step_ms_{DECODE_BATCH}"] = timed_ms(step, device)
    engine.graphs = None  # the same step eager, as the runtime runs what no graph covers
    try:
        fig[f"{key}_decode_step_eager_ms_{DECODE_BATCH}"] = timed_ms(step, device)
    finally:
        engine.graphs = graphs
    fig.write()
    bandwidth = read_bandwidth(device)
    fig["read_bandwidth_gbs"] = bandwidth / 1e9
    ms = fig[f"{key}_decode_step_ms_{DECODE_BATCH}"]
    fig[f"{key}_decode_bound_ms_{DECODE_BATCH}"] = step_bytes(engine, DECODE_BATCH, DECODE_CONTEXT) / bandwidth * 1e3
    fig[f"{key}_decode_over_bound_{DECODE_BATCH}"] = ms / fig[f"{key}_decode_bound_ms_{DECODE_BATCH}"]
    fig[f"{key}_decode_tokens_per_s_{DECODE_BATCH}"] = DECODE_BATCH / (ms / 1e3)
    fig[f"{key}_cuda_graph_speedup_{DECODE_BATCH}"] = fig[f"{key}_decode_step_eager_ms_{DECODE_BATCH}"] / ms
    fig.write()
    first = DECODE_BATCH * (DECODE_CONTEXT // engine.block_size + 1)  # blocks past the decode sequences'
    blocks = list(range(first, first + -(-PREFILL_CHUNK // engine.block_size)))
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch

    chunk = StepBatch.from_sequences([SequenceChunk(0, 0, [i % 1000 for i in range(PREFILL_CHUNK)], blocks)])
    fig[f"{key}_prefill_ms_8k"] = timed_ms(lambda: engine.step_logits(chunk), device, iters=1, warmup=1)
    fig[f"{key}_prefill_tokens_per_s_8k"] = PREFILL_CHUNK / (fig[f"{key}_prefill_ms_8k"] / 1e3)


def run(fig: Figures, work: Path, preset: str, serve: bool, timing: bool, device: str = "cuda") -> None:
    from moe_export.runtime import LLM, SamplingParams

    key = preset.replace("-", "_")
    with fig.stage(f"{key}_build"):
        start = time.perf_counter()
        rec, _ = load_recipe(one_gpu_recipe(work, preset, device))
        engine = work / rec.name
        build(rec, engine)
        fig[f"{key}_build_s"] = time.perf_counter() - start
    if f"{key}_build_error" in fig:
        return
    llm = None
    with fig.stage(f"{key}_load"):
        start = time.perf_counter()
        llm = LLM(engine)
        fig[f"{key}_load_s"] = time.perf_counter() - start  # weights, pools, kernel warm-up and CUDA graph capture
    if llm is not None:
        with fig.stage(f"{key}_generate"):
            start = time.perf_counter()
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            fig[f"{key}_engine_tokens"] = llm.generate([PROMPT], params)[0].output_ids
            fig[f"{key}_generate_s"] = time.perf_counter() - start
        if timing:
            with fig.stage(f"{key}_decode_timing"):
                decode_timing(fig, llm.engine, key)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    with fig.stage(f"{key}_reference"):
        ref_tokens, ref_logits = reference_greedy(next((engine / ".cache").glob("source-*")))
        fig[f"{key}_reference_tokens"] = ref_tokens
        if f"{key}_engine_tokens" in fig:
            fig.update({f"{key}_{k}": v for k, v in compare(fig[f"{key}_engine_tokens"], ref_tokens,
                                                             ref_logits).items()})
    if serve:
        with fig.stage("serve"):
            fig.update(check_serve(engine, work / "serve.log"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--preset", choices=("tiny-k3", "mid-k3"), default="tiny-k3")
    ap.add_argument("--serve", action="store_true", help="then `moe-export serve` answering the openai client")
    ap.add_argument("--decode-timing", action="store_true", help="then decode steps timed on the runtime's path")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the dry run of the CPU tests (tiny-k3 on the CPU; its figures mean nothing)")
    args = ap.parse_args()
    if args.device == "cpu" and (args.preset != "tiny-k3" or args.decode_timing):
        ap.error("--device cpu runs tiny-k3 without --decode-timing (CUDA graphs) only")
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-torch-"))
    work.mkdir(parents=True, exist_ok=True)
    fig = Figures(args.json, preset=args.preset)
    with fig.stage("device"):
        fig["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    if "device_error" in fig and args.preset == "mid-k3":
        return  # no GPU: building 10 GB for it would only spend the command's minutes (tiny-k3 goes on, on the CPU)
    run(fig, work, args.preset, args.serve, args.decode_timing, args.device)


if __name__ == "__main__":
    main()

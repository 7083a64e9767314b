"""The torch backend end to end on one GPU (a lent H200; `gpu_torch_check.sh` runs it), against the fp32 PyTorch
reference on the source checkpoint (CPU):

  - tiny-k3 and mid-k3 (`moe-export synth`; mid-k3 is K3 at its real widths, about 10 GB) built with backend torch
    for one GPU, then `LLM(engine).generate` greedily for 16 tokens (bf16 activations, Triton kernels, decode
    from CUDA graphs) and the reference's greedy tokens on the same prompt. Reported per model: the tokens, the
    first divergence (or none) and there the reference's gap between its top two logits and the engine's choice's
    reference logit below the top (a divergence at a gap under `NEAR_TIE` is a near-tie that bf16 rounding can
    flip);
  - `moe-export serve` of the tiny engine on the GPU answering the official `openai` client's chat completion
    (skipped, with the missing module named, where fastapi / uvicorn / openai are not installed).
`--json PATH` writes the figures; `--skip-mid` leaves mid-k3 out; `--work DIR` keeps the checkpoints and engines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from moe_export.export.build import build
from moe_export.graphs.model import KimiModel
from moe_export.recipes.schema import load_recipe

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]
NEW_TOKENS = 16
NEAR_TIE = 0.05  # reference logit gap (fp32) under which bf16 rounding may pick the other token


def one_gpu_recipe(work: Path, preset: str) -> Path:
    """The preset on one H200 with backend torch (mid-k3: its shipped recipe)."""
    if preset == "mid-k3":
        data = yaml.safe_load(Path(load_recipe("mid-k3-h200.yaml")[1]).read_text())
    else:
        data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
        data.update(name=f"{preset}-h200-torch", model={"source": f"synthetic:{preset}"}, backend="torch",
                    target={"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "memory_gib": 141},
                    parallel={"tp": 1, "ep": 1})
        data["limits"]["max_batch"] = 8
    path = work / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def reference_greedy(checkpoint: Path) -> tuple[list[int], list[torch.Tensor]]:
    """The fp32 reference's greedy tokens and the logits each was chosen from."""
    model = KimiModel.from_checkpoint(checkpoint)
    cache = model.new_cache(1)
    logits = model(torch.tensor([PROMPT]), cache)[0, -1]
    tokens, seen = [], []
    for _ in range(NEW_TOKENS):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model.decode(torch.tensor([tokens[-1]]), cache)[0]
    return tokens, seen


def compare(engine_tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> dict:
    out = {"engine_tokens": engine_tokens, "reference_tokens": ref_tokens, "first_divergence": None}
    for i, (a, b) in enumerate(zip(engine_tokens, ref_tokens)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            out.update(first_divergence=i, reference_top2_gap=float(top2[0] - top2[1]),
                       engine_choice_below_top=float(top2[0] - ref_logits[i][a]))
            out["near_tie"] = out["engine_choice_below_top"] < NEAR_TIE
            break
    return out


def check_model(work: Path, preset: str) -> tuple[dict, Path]:
    from moe_export.runtime import LLM, SamplingParams

    fig: dict = {}
    t0 = time.perf_counter()
    rec, _ = load_recipe(one_gpu_recipe(work, preset))
    engine = work / rec.name
    build(rec, engine)
    fig["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(engine)
    fig["load_s"] = time.perf_counter() - t0  # weights, pools, kernel warm-up and CUDA graph capture
    t0 = time.perf_counter()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    fig["generate_s"] = time.perf_counter() - t0
    del llm
    torch.cuda.empty_cache()
    ref_tokens, ref_logits = reference_greedy(next((engine / ".cache").glob("source-*")))
    fig.update(compare(out.output_ids, ref_tokens, ref_logits))
    return fig, engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve(engine: Path) -> dict:
    """`moe-export serve` on the GPU, one chat completion through the official openai client."""
    try:
        import fastapi  # noqa: F401
        import openai
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return {"serve": f"skipped: {exc.name} is not installed"}
    port = free_port()
    code = f"from moe_export.runtime.entrypoints.cli import main; import sys; sys.argv=['moe-export','serve','{engine}','--port','{port}']; main()"
    server = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 240
        while True:
            try:
                reply = client.chat.completions.create(model=engine.name, max_tokens=8,
                                                       messages=[{"role": "user", "content": "Hello"}])
                break
            except openai.APIConnectionError:
                if time.time() > deadline or server.poll() is not None:
                    return {"serve": "failed: the server did not come up"}
                time.sleep(2)
        return {"serve": "ok", "serve_finish_reason": reply.choices[0].finish_reason,
                "serve_completion_tokens": reply.usage.completion_tokens}
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-mid", action="store_true")
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-torch-"))
    work.mkdir(parents=True, exist_ok=True)
    fig: dict = {"device": torch.cuda.get_device_name(0)}
    tiny, engine = check_model(work, "tiny-k3")
    fig["tiny-k3"] = tiny
    fig.update(check_serve(engine))
    if not args.skip_mid:
        fig["mid-k3"] = check_model(work, "mid-k3")[0]
    text = json.dumps(fig, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""The one check for a machine with TensorRT (>= 10.9) and at least 2 GPUs; it has never run (no such machine here).

    python benchmarks/tensorrt_check.py --out /tmp/trt_check            (world 1 builds, runs, compares;
                                                                        then starts the world-2 part itself)

1. Builds the tiny synthetic K3 (tiny-k3, fp32 cache for exact comparison) four times: backend onnxruntime and
   backend tensorrt, each at world 1 (tp=1, ep=1) and world 2 (tp=2, ep=2): the TensorRT builds exercise the
   ONNX parser on our graphs (int8 MXFP4 views, plugin fields), the QDP plugins at build time, one engine per
   rank with the collective plugins idle while building, and the device-memory check against the plan.
2. Prints each TensorRT engine's layers (TensorRT's engine inspector) and device memory (`describe_engine`).
3. Runs a prompt (prefill) and 8 greedy decode steps through the ONNX Runtime and the TensorRT engine of each
   world size and prints the largest logit difference per step (bf16 compute on TensorRT: expect ~1e-2, and
   the same greedy tokens). World 2 runs under `mpiexec -n 2` (one GPU per rank, NCCL inside the engines).
4. Wide EP: builds both backends at world 2 in the dp layout (tp 1 x dp 2, experts over both ranks: the
   MoEDispatch / MoECombine plugins with their static receive buffers) and runs the same steps under
   `mpiexec -n 2` with rank 0's group stepping the prompt and rank 1's group idle (`step(None)`: its dummy token
   sends nothing, its experts still serve rank 0's tokens); rank 0's logits and tokens are compared.
5. Image input (K3): the world-1 TensorRT builds also built the tower (`vision.engine`: the ONNX parser on the
   tower graph's Loop over images); one image (with transparency) goes through both world-1 engines: the
   tower's embeddings (largest difference, fp32 on both) and an image chat's 8 greedy tokens are compared.
Exit status 1 if a build fails, an engine cannot run, or the greedy tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5, 300, 21, 8, 77, 140]
STEPS = 8


def recipe(out: Path, backend: str, world: int, attention: str = "tp") -> Path:
    from moe_export.common.recipe import load_recipe

    tag = f"w{world}" + ("dp" if attention == "dp" else "")
    base = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    base.update(name=f"check-{backend}-{tag}", backend=backend, output=str(out / f"{backend}-{tag}"))
    base["quantization"]["kv_cache"] = "fp32"
    base["target"].update(gpus_per_node=world, gpu="h100" if backend == "tensorrt" else "cpu")
    if backend == "tensorrt":
        base["target"]["memory_gib"] = 8
    base["parallel"] = {"tp": world if attention == "tp" else 1, "ep": world, "attention": attention}
    path = out / f"{base['name']}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def run_steps(engine_dir: Path, idle: bool = False) -> tuple[list[np.ndarray], list[int]]:
    """Prefill PROMPT then STEPS greedy decode steps: (logits of each step, greedy tokens); `idle` (dp layout):
    this rank's group runs as many idle steps instead."""
    from moe_export.runtime.engine import open_engine
    from moe_export.runtime.engine.batch import SequenceChunk, StepBatch

    eng = open_engine(engine_dir)
    if idle:
        for _ in range(STEPS):
            eng.step(None)
        return [], []
    bs = eng.block_size
    table = list(range(-(-(len(PROMPT) + STEPS) // bs)))
    logits = [eng.step(StepBatch.from_sequences([SequenceChunk(0, 0, PROMPT, table)]))[0]]
    tokens = [int(np.argmax(logits[-1]))]
    for i in range(STEPS - 1):
        out = eng.step(StepBatch.from_sequences([SequenceChunk(0, len(PROMPT) + i, [tokens[-1]], table)]))[0]
        logits.append(out)
        tokens.append(int(np.argmax(out)))
    return logits, tokens


def compare(world: int, out: Path, dp: bool = False) -> bool:
    tag = f"w{world}" + ("dp" if dp else "")
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    ort_logits, ort_tokens = run_steps(out / f"onnxruntime-{tag}", idle=dp and rank != 0)
    trt_logits, trt_tokens = run_steps(out / f"tensorrt-{tag}", idle=dp and rank != 0)
    if rank != 0:
        return True
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ort_logits, trt_logits)]
    print(json.dumps({"engines": tag, "max_abs_logit_diff_per_step": diffs, "ort_tokens": ort_tokens,
                      "trt_tokens": trt_tokens, "same_tokens": ort_tokens == trt_tokens}))  # fmt: skip
    return ort_tokens == trt_tokens


def compare_images(out: Path) -> bool:
    """Part 5: one image through the world-1 engines of both backends (tower embeddings, image chat tokens)."""
    import base64
    import io

    from moe_export.runtime import LLM, SamplingParams
    from moe_export.runtime.images import PromptImages
    from PIL import Image

    rgba = np.random.default_rng(0).integers(0, 256, (100, 150, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe the picture."},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    got = {}
    for backend in ("onnxruntime", "tensorrt"):
        llm = LLM(out / f"{backend}-w1")
        try:
            images = PromptImages(llm.tokenizer, llm.engine.vision.processor, messages)
            items = [(im.pixel_values, list(im.plan.grid)) for im in images.parts.values()]
            (embeds,) = llm.engine.encode_images(items)
            (answer,) = llm.chat([messages], SamplingParams(temperature=0, max_tokens=STEPS), reasoning_effort="none")
            got[backend] = (embeds, answer.output_ids)
        finally:
            llm.shutdown()
    (ort_emb, ort_tokens), (trt_emb, trt_tokens) = got["onnxruntime"], got["tensorrt"]
    print(json.dumps({"images": "w1", "max_abs_embedding_diff": float(np.abs(ort_emb - trt_emb).max()),
                      "ort_tokens": ort_tokens, "trt_tokens": trt_tokens, "same_tokens": ort_tokens == trt_tokens}))
    return ort_tokens == trt_tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--world2-run", action="store_true", help="(internal) the mpiexec -n 2 part")
    ap.add_argument("--dp", action="store_true", help="(internal) with --world2-run: the dp-layout engines")
    args = ap.parse_args()
    out = args.out
    if args.world2_run:
        return 0 if compare(2, out, dp=args.dp) else 1
    out.mkdir(parents=True, exist_ok=True)
    from moe_export.common.recipe import load_recipe
    from moe_export.export import build as driver
    from moe_export.export.backends.tensorrt.engine import describe_engine

    for world, attention in ((1, "tp"), (2, "tp"), (2, "dp")):
        tag = f"w{world}" + ("dp" if attention == "dp" else "")
        for backend in ("onnxruntime", "tensorrt"):
            rec, _ = load_recipe(recipe(out, backend, world, attention))
            driver.build(rec, out / f"{backend}-{tag}")
        for rank in range(world):
            info = describe_engine(out / f"tensorrt-{tag}" / f"rank{rank}" / f"rank{rank}.engine")
            names = [layer.get("Name", str(layer)) if isinstance(layer, dict) else str(layer) for layer in info["layers"]]
            print(f"{tag} rank {rank}: {info['num_layers']} layers, device memory "
                  f"{info['device_memory_bytes'] / 2**20:.1f} MiB (recorded {info['recorded']['device_memory_bytes']})")
            print("  " + "\n  ".join(names))
    ok = compare(1, out)
    images_ok = compare_images(out)
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, __file__, "--out", str(out), "--world2-run"])
    wide = subprocess.run(["mpiexec", "-n", "2", sys.executable, __file__, "--out", str(out), "--world2-run", "--dp"])
    return 0 if ok and images_ok and res.returncode == 0 and wide.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

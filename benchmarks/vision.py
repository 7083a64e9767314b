"""Vision: image preprocessing + tower throughput, and the embedding cache's time-to-first-token gain.

  preprocess / tower    images/s and merged tokens/s at 448x448 and 1920x1080 (random RGB PNGs): Pillow
                        preprocessing (`runtime.images`), and the tower + projector graph under ONNX Runtime
                        (`graphs.vision_export`, one image per call), for the tiny-k3 tower (2 x 32, 2 heads) and a
                        mid-size tower (MID: 4 x 512, 4 heads of 128, MLP 2048, projector to 1024; random weights).
                        Patch limit 4096 (the CPU recipe tiny-cpu's `limits.max_image_patches`: 1920x1080 -> 72 x 56
                        patches, 1008 tokens); `--patch-limit 65536` runs 1920x1080 at its full 78 x 138 grid (2691
                        tokens; about a minute per mid-tower call on 2 cores).
  vision_cache_ttft_speedup  time to first token of a one-image chat (one 1920x1080 PNG, 1008 image tokens, 1090
                        prompt tokens) where the tower dominates: tiny-k3's text model on one rank (max_seq_len /
                        max_num_tokens 2048, so the prompt is one scheduler step) with the MID tower (projector to
                        the text width 64; `write_synthetic_checkpoint(vision=...)`), patch limit 4096, one image per
                        request. Cold: the image's embeddings cleared (decode, resize, tower, prefill); hot: cached
                        (the bytes hashed, the header read for the size, prefill; no decode, resize or tower call);
                        on one warmed-up LLM, alternating, session reuse off so the prefill is the same. Goal >= 3.

    python benchmarks/vision.py [--rounds 3] [--quick] [--patch-limit 4096] [--json PATH]

Prints `loadavg_1min` (read at the start and the end); the JSON is flat: `preprocess_448x448_images_per_s`,
`tower_mid_1920x1080_merged_tokens_per_s`, ..., `ttft_cold_s`, `ttft_hot_s`, `vision_cache_ttft_speedup`,
`image_tokens`, `prompt_tokens`, `loadavg_1min`, `loadavg_1min_end`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from moe_export.graphs.vision import VISION_NORM_EPS, VisionConfig, vision_tensor_specs
from moe_export.graphs.vision_export import export_vision_graph, tower_inputs
from moe_export.runtime.images import ImageProcessor
from PIL import Image
from safetensors.torch import save_file

SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080)}
TINY = VisionConfig(14, 8, 8, 4, "bilinear", 32, 2, 2, 32, 64, (2, 2), 32, 1e-5, 64)
MID = VisionConfig(14, 64, 64, 4, "bilinear", 512, 4, 4, 512, 2048, (2, 2), 512, 1e-5, 1024)
# MID's tower as vision_config keys of a synthetic tiny-k3 checkpoint (its projector maps to the text width)
MID_TOWER = {"init_pos_emb_height": 64, "init_pos_emb_width": 64, "vt_hidden_size": 512, "vt_num_hidden_layers": 4,
             "vt_num_attention_heads": 4, "qkv_hidden_size": 512, "vt_intermediate_size": 2048, "mm_hidden_size": 512}
CPU_PATCH_LIMIT = 4096  # recipes/tiny-cpu.yaml limits.max_image_patches


def png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_tower(vc: VisionConfig, root: Path) -> None:
    """The tower graph of `vc` in `root`, over random weights (fan-in scaled, norms ~1)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for s in vision_tensor_specs(vc):
        t = torch.randn(s.shape, generator=gen)
        t = 1 + 0.1 * t if len(s.shape) == 1 else t / max(1, int(np.prod(s.shape[1:]))) ** 0.5
        tensors[s.name] = t.to(torch.bfloat16)
    save_file(tensors, str(root / "vision.safetensors"))
    export_vision_graph(vc, root / "vision.safetensors", root / "vision.onnx", VISION_NORM_EPS["float32"])


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(rounds: int, quick: bool, patch_limit: int) -> dict:
    proc = ImageProcessor().with_patch_limit(patch_limit)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        towers = {"tiny": TINY} if quick else {"tiny": TINY, "mid": MID}
        for name, (w, h) in SIZES.items():
            data = png(w, h)
            prep = proc.prepare_bytes(data, name)
            tokens = prep.num_tokens
            sec = timed(lambda data=data, name=name: proc.prepare_bytes(data, name).pixel_values, rounds)
            out[f"preprocess_{name}"] = {"images_per_s": 1 / sec, "merged_tokens_per_s": tokens / sec, "tokens": tokens}
            for tname, vc in towers.items():
                folder = Path(tmp) / tname
                folder.mkdir(exist_ok=True)
                if not (folder / "vision.onnx").is_file():
                    write_tower(vc, folder)
                opts = ort.SessionOptions()
                opts.enable_cpu_mem_arena = False
                sess = ort.InferenceSession(str(folder / "vision.onnx"), opts, providers=["CPUExecutionProvider"])
                feeds = tower_inputs(vc, prep.pixel_values, [prep.plan.grid])
                sess.run(None, feeds)  # warm-up
                sec = timed(lambda sess=sess, feeds=feeds: sess.run(None, feeds), rounds)
                out[f"tower_{tname}_{name}"] = {"images_per_s": 1 / sec, "merged_tokens_per_s": tokens / sec,
                                                "tokens": tokens, "params": vc.params()}
    return out


def cache_ttft(rounds: int) -> dict:
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build
    from moe_export.export.convert.synth import write_synthetic_checkpoint
    from moe_export.runtime import LLM, SamplingParams

    url = "data:image/png;base64," + base64.b64encode(png(1920, 1080, seed=1)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    one = SamplingParams(temperature=0, max_tokens=1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_synthetic_checkpoint("tiny-k3", Path(tmp) / "checkpoint", vision=MID_TOWER)
        recipe = load_recipe("tiny-cpu.yaml")[0]
        recipe = recipe.model_copy(update={
            "model": recipe.model.model_copy(update={"source": str(checkpoint)}),
            "parallel": recipe.parallel.model_copy(update={"tp": 1, "ep": 1}),
            "target": recipe.target.model_copy(update={"gpus_per_node": 1}),
            "limits": recipe.limits.model_copy(update={"max_seq_len": 2048, "max_num_tokens": 2048,
                                                       "max_image_patches": CPU_PATCH_LIMIT, "max_images_per_request": 1}),
            "workspace_reserve_gib": 1.0,  # one MID call at 4096 patches: 0.59 GiB of activations
        })
        build(recipe, Path(tmp) / "engine", progress=False)
        llm = LLM(Path(tmp) / "engine", reuse_sessions=False, prefix_caching=False)
        try:
            llm.chat([messages], one, reasoning_effort="none")  # warm-up: ONNX Runtime's first runs
            cold, hot = [], []
            for _ in range(rounds):
                llm.engine.vision.clear_cache()  # cold: the image is decoded, resized and encoded
                t0 = time.perf_counter()
                out = llm.chat([messages], one, reasoning_effort="none")[0]
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()  # hot: the same image again, its embeddings cached
                llm.chat([messages], one, reasoning_effort="none")
                hot.append(time.perf_counter() - t0)
            tokens = out.prompt_ids.count(llm.engine.media_pad_id)
            stats = llm.engine.vision.stats()
        finally:
            llm.shutdown()
    if stats["hits"] < rounds:
        raise RuntimeError(f"the hot requests missed the embedding cache: {stats}")
    return {"ttft_cold_s": statistics.median(cold), "ttft_hot_s": statistics.median(hot), "image_tokens": tokens,
            "prompt_tokens": len(out.prompt_ids),
            "vision_cache_ttft_speedup": statistics.median(cold) / statistics.median(hot)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny tower only in the throughput part")
    ap.add_argument("--patch-limit", type=int, default=CPU_PATCH_LIMIT, help="throughput part: patches per image")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"loadavg_1min {load:.2f}")
    results = {"throughput": throughput(args.rounds, args.quick, args.patch_limit), "cache": cache_ttft(args.rounds)}
    load_end = os.getloadavg()[0]
    for key, row in results["throughput"].items():
        print(f"{key:28s} {row['images_per_s']:9.2f} images/s {row['merged_tokens_per_s']:11.0f} merged tokens/s")
    c = results["cache"]
    print(f"TTFT one 1920x1080 image, mid tower ({c['image_tokens']} image tokens, {c['prompt_tokens']} prompt tokens): "
          f"cold {c['ttft_cold_s'] * 1e3:.0f} ms, cached {c['ttft_hot_s'] * 1e3:.0f} ms, "
          f"vision_cache_ttft_speedup {c['vision_cache_ttft_speedup']:.2f} (goal >= 3)")
    print(f"loadavg_1min {load:.2f} at the start, {load_end:.2f} at the end")
    if args.json:  # flat, as every benchmark writes it
        flat = {f"{key}_{k}": v for key, row in results["throughput"].items() for k, v in row.items()}
        flat.update(results["cache"], loadavg_1min=load, loadavg_1min_end=load_end, patch_limit=args.patch_limit)
        args.json.write_text(json.dumps(flat, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

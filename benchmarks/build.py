"""Benchmark of `moe-export build`: wall time and peak memory per rank for two model sizes.

Two synthetic K3-style checkpoints are written: `tiny-k3` and the same architecture with every width
and the expert count multiplied by `--scale` (default 8) and its layer pattern repeated `--layer-scale` times
(default 4: 28 layers). Also reported: bytes of the checkpoint each process read / bytes its ranks need
(`bytes_read_per_needed`: tensor data counted at the reader, plus every read of a source file through a
Python file object or a file copy; memory-map page granularity is not counted). Each is built with a
4-rank CPU recipe (tp=2, ep=2, ONNX Runtime backend) under `mpiexec -n 4`, so each MPI process
builds exactly one rank and its peak RSS is that rank's; `baseline` is the RSS after the imports,
before the build. Two figures: `peak_rss` (ru_maxrss: includes the memory-mapped checkpoint pages the
process touched, which the kernel can drop) and `peak_anon_rss` (sampled RssAnon: the heap the build
really needs). Without mpiexec the ranks are built in one process (one figure for all). The converter
streams the checkpoint, so the anonymous peak should stay near flat as the model grows.
``run()`` returns a flat dict; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

WORLD, TP, EP = 4, 2, 2

CHILD = r"""
import json, resource, sys, threading, time
import moe_export.export.backends, moe_export.export.convert, moe_export.graphs.onnx_export
from moe_export.common.mpi import world_comm
from moe_export.export.build import build
from moe_export.common.recipe import load_recipe

def rss_anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0

peak_anon = [rss_anon_kib()]
done = threading.Event()
def sample():
    while not done.wait(0.005):
        peak_anon[0] = max(peak_anon[0], rss_anon_kib())
import builtins, io, os, shutil
from pathlib import Path
import moe_export.export.build.driver as build_mod
from moe_export.export.convert import checkpoint
from moe_export.export.convert.rank import rank_source_bytes
from moe_export.common.mapping import Mapping
source_root = Path(sys.argv[3])
readers, hashed, file_read = [], [0], [0]
real_init, real_sha, real_open, real_copy = (checkpoint.CheckpointReader.__init__, build_mod.sha256_file, io.open,
                                             shutil.copyfile)
def in_source(path):
    return not isinstance(path, int) and Path(os.fsdecode(path)).resolve().is_relative_to(source_root)
class CountedFile:  # every byte read through a Python file object of a source file (headers, index, JSON, hashing)
    def __init__(self, f): self._f = f
    def _add(self, data):
        file_read[0] += len(data.encode() if isinstance(data, str) else data)
        return data
    def read(self, *a): return self._add(self._f.read(*a))
    def readline(self, *a): return self._add(self._f.readline(*a))
    def readinto(self, b):
        n = self._f.readinto(b)
        file_read[0] += n or 0
        return n
    def __iter__(self): return (self._add(line) for line in self._f)
    def __enter__(self): return self
    def __exit__(self, *exc): return self._f.__exit__(*exc)
    def __getattr__(self, name): return getattr(self._f, name)
def counting_open(file, *a, **kw):
    f = real_open(file, *a, **kw)
    return CountedFile(f) if in_source(file) else f
def counting_copy(src, dst, **kw):  # copies go through sendfile, not read()
    if in_source(src):
        file_read[0] += os.path.getsize(src)
    return real_copy(src, dst, **kw)
def tracking_init(self, *a, **kw):
    real_init(self, *a, **kw)
    readers.append(self)
def counting_sha(path):
    if in_source(path):  # a source file, not one of the build's outputs
        hashed[0] += path.stat().st_size
    return real_sha(path)
io.open = builtins.open = counting_open
shutil.copyfile = counting_copy
checkpoint.CheckpointReader.__init__ = tracking_init
build_mod.sha256_file = counting_sha
comm = world_comm()
recipe = load_recipe(sys.argv[1])[0]
baseline, baseline_anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rss_anon_kib()
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
build(recipe, sys.argv[2], progress=False)
seconds = time.perf_counter() - t0
done.set()
mine = [n for n in range(recipe.target.world_size) if n % comm.size == comm.rank]
needed = sum(rank_source_bytes(readers[0], readers[0].config, Mapping.from_recipe(recipe, n)) for n in mine)
open(f"{sys.argv[2]}.process{comm.rank}.json", "w").write(json.dumps({"process": comm.rank, "seconds": seconds, "read_bytes": sum(r.bytes_read for r in readers),
                  "hash_bytes": hashed[0], "file_read_bytes": file_read[0], "needed_bytes": needed, "baseline_kib": baseline, "peak_kib":
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "baseline_anon_kib": baseline_anon,
                  "peak_anon_kib": max(peak_anon[0], rss_anon_kib())}))  # a file each: mpiexec mixes stdout lines
"""


def scaled_hf_config(scale: int, layer_scale: int) -> dict:
    """tiny-k3's HF config with widths, head counts and the expert count multiplied by `scale`, and its
    layer pattern (KDA / MLA) repeated `layer_scale` times."""
    from moe_export.export.convert.synth import preset_hf_config

    cfg = preset_hf_config("tiny-k3")
    text = cfg["text_config"]
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "routed_expert_hidden_size",
                "q_lora_rank", "kv_lora_rank", "num_attention_heads", "num_key_value_heads", "num_experts"):
        text[key] *= scale
    lac = text["linear_attn_config"]
    lac["num_heads"] *= scale
    n = text["num_hidden_layers"]
    for key in ("kda_layers", "full_attn_layers"):
        lac[key] = [layer + r * n for r in range(layer_scale) for layer in lac[key]]
    text["num_hidden_layers"] = n * layer_scale
    if "vision_config" in cfg:  # the tower projects into the text model's width
        cfg["vision_config"]["text_hidden_size"] = text["hidden_size"]
    return cfg


def write_checkpoint(name: str, scale: int, layer_scale: int, out: Path) -> Path:
    """A synthetic checkpoint (seed 0); scale 1, layer_scale 1 is the tiny-k3 preset itself."""
    from moe_export.export.convert import synth

    if (scale, layer_scale) != (1, 1):
        synth.PRESETS[name] = lambda: scaled_hf_config(scale, layer_scale)
    return synth.write_synthetic_checkpoint(name if (scale, layer_scale) != (1, 1) else "tiny-k3", out, seed=0)


def write_recipe(path: Path, source: Path) -> Path:
    recipe = {
        "name": f"bench-{source.name}",
        "model": {"source": str(source)},
        "target": {"gpu": "cpu", "nodes": 1, "gpus_per_node": WORLD, "memory_gib": 64},
        "parallel": {"tp": TP, "ep": EP},
        "limits": {"max_batch": 8, "max_seq_len": 512, "max_num_tokens": 512},
        "backend": "onnxruntime",
        "workspace_reserve_gib": 0.25,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def build_once(recipe: Path, out: Path, use_mpi: bool) -> list[dict]:
    """Run the build in fresh processes; one JSON record per process."""
    source = yaml.safe_load(recipe.read_text())["model"]["source"]
    cmd = [sys.executable, "-c", CHILD, str(recipe), str(out), str(Path(source).resolve())]
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if use_mpi:
        cmd = [str(mpiexec), "-n", str(WORLD), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({' '.join(cmd[:4])} ...):\n{proc.stderr[-4000:]}")
    records = [json.loads(p.read_text()) for p in out.parent.glob(f"{out.name}.process*.json")]
    return sorted(records, key=lambda r: r["process"])


def run(scale: int = 8, layer_scale: int = 4, use_mpi: bool | None = None) -> dict[str, float]:
    """Figures for both sizes: checkpoint size, parameters, build seconds, peak / baseline RSS per rank."""
    from moe_export.common.model_config import ModelConfig
    from moe_export.export.plan.planner import count_params

    if use_mpi is None:
        use_mpi = (Path(sys.executable).parent / "mpiexec").is_file()
    figures: dict[str, float] = {"world_size": WORLD, "mpi": int(use_mpi), "scale": scale, "layer_scale": layer_scale}
    work = Path(tempfile.mkdtemp(prefix="moe-export-bench-build-"))
    try:
        for label, factor, layers in (("small", 1, 1), ("large", scale, layer_scale)):
            t0 = time.perf_counter()
            ckpt = write_checkpoint(f"bench-k3-x{factor}-l{layers}", factor, layers, work / f"ckpt-{label}")
            figures[f"{label}.layers"] = ModelConfig.from_pretrained(ckpt).num_layers
            figures[f"{label}.synth_s"] = round(time.perf_counter() - t0, 2)
            total, _ = count_params(ModelConfig.from_pretrained(ckpt))
            figures[f"{label}.params_m"] = round(total / 1e6, 2)
            figures[f"{label}.checkpoint_mib"] = round(
                sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 2**20, 2)
            recipe = write_recipe(work / f"{label}.yaml", ckpt)
            records = build_once(recipe, work / f"engine-{label}", use_mpi)
            figures[f"{label}.build_s"] = round(max(r["seconds"] for r in records), 2)
            # bytes of the checkpoint each process read over the bytes its ranks' weights come from (goal <= 1.05):
            # tensor data through the reader (convert_read_over_needed), plus whole source files hashed with
            # sha256_file (read_over_needed), plus every other read of a source file through a Python file
            # object or a copy: headers, index, config, tokenizer (bytes_read_per_needed, all of them)
            for r in records:
                who = f"rank{r['process']}" if use_mpi else "all_ranks"
                figures[f"{label}.convert_read_over_needed.{who}"] = round(r["read_bytes"] / r["needed_bytes"], 3)
                figures[f"{label}.read_over_needed.{who}"] = round(
                    (r["read_bytes"] + r["hash_bytes"]) / r["needed_bytes"], 3)
                figures[f"{label}.bytes_read_per_needed.{who}"] = round(
                    (r["read_bytes"] + r["file_read_bytes"]) / r["needed_bytes"], 3)
                figures[f"{label}.nontensor_read_kib.{who}"] = round(r["file_read_bytes"] / 1024, 1)
            for r in records:
                who = f"rank{r['process']}" if use_mpi else "all_ranks"
                for key in ("peak", "baseline", "peak_anon", "baseline_anon"):
                    figures[f"{label}.{key}_rss_mib.{who}"] = round(r[f"{key}_kib"] / 1024, 1)
            for key in ("peak", "peak_anon"):
                figures[f"{label}.{key}_rss_mib.max"] = max(round(r[f"{key}_kib"] / 1024, 1) for r in records)
            figures[f"{label}.rank_weights_mib"] = round(
                (work / f"engine-{label}" / "rank0" / "weights.safetensors").stat().st_size / 2**20, 2)
            shutil.rmtree(work / f"engine-{label}")
            shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures["checkpoint_growth_x"] = round(figures["large.checkpoint_mib"] / figures["small.checkpoint_mib"], 1)
    for key in ("peak", "peak_anon"):
        figures[f"{key}_rss_growth_mib"] = round(
            figures[f"large.{key}_rss_mib.max"] - figures[f"small.{key}_rss_mib.max"], 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="width / expert multiplier of the large model")
    parser.add_argument("--layer-scale", type=int, default=4, help="layer-count multiplier of the large model")
    parser.add_argument("--no-mpi", action="store_true", help="build the ranks in one process")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.scale, args.layer_scale = 2, 1
    if args.scale < 2 or math.log2(args.scale) % 1:
        parser.error("--scale must be a power of two >= 2 (keeps every width a multiple of 32 and divisible by tp/ep)")
    figures = run(args.scale, args.layer_scale, use_mpi=False if args.no_mpi else None)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

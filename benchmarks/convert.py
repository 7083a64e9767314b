"""Convert-stage throughput and peak memory on a synthetic checkpoint with real K3 tensor shapes.

The checkpoint is the Kimi K3 config cut to one decoder layer (KDA attention + latent MoE, real
K3 widths: hidden 7168, 96x128 KDA heads, shared experts 6144, latent 3584, expert I 3072), a
reduced vocabulary and `--experts` routed experts stored as K3 stores them (MXFP4 packed U8 +
E8M0 U8 scales); trunk tensors are BF16 / F32 as in K3. Default size ~2.3 GB, largest tensor
176 MB ([12288, 7168] BF16).

Each measurement runs in a fresh child process (so its peak RSS is its own), reading the files
just written (page cache, the same for all):
  raw read:   CheckpointReader.get() of every tensor, its bytes copied into one reused buffer;
  transforms: the export.transforms work of the convert stage without an output file: trunk
              finiteness checks, each expert read once, validated and fused (w13, w2);
  raw copy:   raw read plus writing the same bytes to one file and fsync (the I/O floor of convert);
  convert:    moe_export.export.convert.convert_rank on one rank (tp = ep = 1): the transforms plus
              stacking and the streaming safetensors write (with fsync).
Each runs --rounds times, interleaved round by round (fastest kept).
Peak RSS is reported in total (ru_maxrss) and split, from 20 ms samples, into anonymous memory and
file-backed pages (the reader memory-maps the shards; those pages are page cache, reclaimable).
Throughput = source checkpoint bytes / wall time. Goals: convert >= 0.5x raw read, convert peak
RSS <= 2x largest tensor + 300 MB.

    python benchmarks/convert.py [--experts 48] [--dir DIR] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import TensorSpec, all_tensor_specs

K3_CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "models" / "kimi-k3.json"
POOL_BYTES = 64 << 20  # random bytes reused (at varying offsets) to fill tensors quickly


def bench_hf_config(experts: int, vocab: int) -> dict:
    """The shipped K3 config cut to one KDA + MoE layer, `experts` experts and `vocab` tokens."""
    hf = copy.deepcopy(json.loads(K3_CONFIG.read_text()))
    t = hf["text_config"]
    t.update(num_hidden_layers=1, first_k_dense_replace=0, num_experts=experts,
             num_experts_per_token=min(t["num_experts_per_token"], experts), vocab_size=vocab,
             bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    t["linear_attn_config"] = {**t["linear_attn_config"], "kda_layers": [1], "full_attn_layers": []}
    hf.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return hf


def _fill(spec: TensorSpec, pool: torch.Tensor, k: int) -> bytes:
    """Bytes of tensor number k: pool values (bf16 N(0, 0.02), widened for F32; random codes for U8
    packed weights) from a k-dependent offset, tiled; E8M0 scales cycle through 118..125."""
    n = spec.nbytes
    if spec.name.endswith("weight_scale"):
        return (bytes(118 + (k + i) % 8 for i in range(256)) * (n // 256 + 1))[:n]
    off = 2 * ((k * 7919 * 32) % (pool.numel() // 4))
    need = n // 2 if spec.dtype == "F32" else n
    chunk = pool[off : off + min(need, pool.numel() - off)]
    if spec.dtype == "F32":
        chunk = chunk.view(torch.bfloat16).float().view(torch.uint8)
    raw = chunk.numpy().tobytes()
    return (raw * -(-n // len(raw)))[:n]


def write_checkpoint(out: Path, hf: dict, shard_bytes: int = 1 << 30) -> tuple[int, int]:
    """Write config.json, shards (~shard_bytes each) and the index. Returns (total bytes, largest tensor bytes)."""
    cfg = ModelConfig.from_hf_dict(hf, source="benchmark config")
    specs = all_tensor_specs(cfg)
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL_BYTES // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    shards: list[list[TensorSpec]] = [[]]
    for s in specs:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + s.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(s)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    weight_map = {}
    for i, group in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):06d}.safetensors"
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for s in group:
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
            pos += s.nbytes
            weight_map[s.name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for k, s in enumerate(group):
                f.write(_fill(s, pool, k + 131 * i))
            f.flush()
            os.fsync(f.fileno())  # written back before the measurements start
    total = sum(s.nbytes for s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, max(s.nbytes for s in specs)


class RssSampler(threading.Thread):
    """Samples this process's anonymous and file-backed resident memory (MB) every 20 ms; keeps the peaks."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self.stop = threading.Event()

    def sample(self) -> None:
        for key, mb in _status_mb(*self.peak).items():
            self.peak[key] = max(self.peak[key], mb)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.sample()


def _status_mb(*keys: str) -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in keys:
                out[key] = int(line.split()[1]) / 1024
    return out


def child(mode: str, ckpt: Path, out_dir: Path) -> dict:
    """One measurement in this (fresh) process; returns seconds, peak RSS (total, and the sampled peaks
    of anonymous and file-backed pages) and the RSS before the work."""
    from moe_export.export.convert.checkpoint import CheckpointReader

    base_rss = _status_mb("VmRSS")["VmRSS"]
    sampler = RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    reader = CheckpointReader(ckpt)
    if mode == "read":
        # copy every tensor's bytes out of the (memory-mapped) file into one reused buffer
        buf = torch.empty(max(reader.nbytes(n) for n in reader.tensor_names()), dtype=torch.uint8)
        for name in reader.tensor_names():
            t = reader.get(name)
            buf[: reader.nbytes(name)].copy_(t.reshape(-1).view(torch.uint8))
            del t
        result = {}
    elif mode == "copy":
        # read every tensor and write its bytes to one output file, then fsync: the I/O the convert
        # stage cannot avoid
        with open(out_dir / "copy.bin", "wb") as f:
            for name in reader.tensor_names():
                f.write(memoryview(reader.get(name).reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        (out_dir / "copy.bin").unlink()
        result = {}
    elif mode == "transforms":
        # the convert stage's transforms alone (no output file): finiteness checks of the trunk, each
        # expert read once, validated and fused into w13 / w2 buffers
        from moe_export.export.convert import transforms

        cfg = reader.config
        for name in (n for n in reader.tensor_names() if transforms.parse_expert_name(n) is None):
            transforms.check_finite(name, reader.get(name))
        for layer in (la for la in range(cfg.num_layers) if cfg.is_moe(la)):
            for e in range(cfg.num_experts):
                for fuse in (True, False):
                    transforms.expert_mxfp4(reader, cfg, layer, e, fuse_gate_up=fuse)
        result = {}
    else:
        from moe_export.common.recipe import QuantizationSection
        from moe_export.export.convert.rank import convert_rank
        from moe_export.graphs.sharding import Mapping

        class BenchRecipe:
            """The recipe fields convert_rank reads: quantization choices and the backend."""

            quantization = QuantizationSection()
            backend = "onnxruntime"

        report = convert_rank(reader, reader.config, BenchRecipe(), Mapping(world_size=1, rank=0, tp=1, ep=1),
                              out_dir / "weights.safetensors")
        result = {"quantized_tensors": report["summary"]["quantized_tensors"],
                  "output_bytes": (out_dir / "weights.safetensors").stat().st_size}  # fmt: skip
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    sampler.sample()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "peak_rss_mb": peak, "peak_anon_mb": sampler.peak["RssAnon"],
            "peak_file_mb": sampler.peak["RssFile"], "base_rss_mb": base_rss, **result}  # fmt: skip


def run_child(mode: str, ckpt: Path, out_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(ckpt), str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=48, help="routed experts (17.5 MB each as MXFP4)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (embedding and lm_head rows)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per measurement (fastest kept)")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and output")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.experts, args.vocab, args.rounds = 2, 512, 1
    if args.child:
        mode, ckpt, out = args.child
        print(json.dumps(child(mode, Path(ckpt), Path(out))))
        return
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="convert-bench-"))
    ckpt, out = work / "checkpoint", work / "out"
    out.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        total, largest = write_checkpoint(ckpt, bench_hf_config(args.experts, args.vocab))
        write_s = time.perf_counter() - t0
        modes = ("read", "copy", "transforms", "convert")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.rounds):  # interleaved, so machine noise hits every mode alike
            for m in modes:
                runs[m].append(run_child(m, ckpt, out))
        read, copy_, trans, conv = (min(runs[m], key=lambda x: x["seconds"]) for m in modes)
    finally:
        if not args.keep:
            shutil.rmtree(work if not args.dir else ckpt, ignore_errors=True)
            if args.dir:
                shutil.rmtree(out, ignore_errors=True)
    limit_mb = 2 * largest / 2**20 + 300
    r = {
        "checkpoint_bytes": total,
        "largest_tensor_bytes": largest,
        "experts": args.experts,
        "threads": torch.get_num_threads(),
        "loadavg_1min": os.getloadavg()[0],
        "write_checkpoint_s": write_s,
        "raw_read_s": read["seconds"],
        "raw_read_gbps": total / read["seconds"] / 1e9,
        "raw_read_peak_rss_mb": read["peak_rss_mb"],
        "raw_read_peak_anon_mb": read["peak_anon_mb"],
        "raw_read_peak_file_mb": read["peak_file_mb"],
        "rounds": args.rounds,
        "raw_copy_s": copy_["seconds"],
        "raw_copy_gbps": total / copy_["seconds"] / 1e9,
        "raw_copy_peak_rss_mb": copy_["peak_rss_mb"],
        "raw_copy_peak_anon_mb": copy_["peak_anon_mb"],
        "raw_copy_peak_file_mb": copy_["peak_file_mb"],
        "transforms_s": trans["seconds"],
        "transforms_gbps": total / trans["seconds"] / 1e9,
        "transforms_vs_raw_read": read["seconds"] / trans["seconds"],
        "transforms_peak_rss_mb": trans["peak_rss_mb"],
        "transforms_peak_anon_mb": trans["peak_anon_mb"],
        "transforms_peak_file_mb": trans["peak_file_mb"],
        "convert_s": conv["seconds"],
        "convert_gbps": total / conv["seconds"] / 1e9,
        "convert_vs_raw_read": read["seconds"] / conv["seconds"],
        "convert_vs_raw_copy": copy_["seconds"] / conv["seconds"],
        "convert_peak_rss_mb": conv["peak_rss_mb"],
        "convert_peak_anon_mb": conv["peak_anon_mb"],
        "convert_peak_file_mb": conv["peak_file_mb"],
        "convert_base_rss_mb": conv["base_rss_mb"],
        "convert_rss_limit_mb": limit_mb,
        "convert_rss_within_limit": conv["peak_rss_mb"] <= limit_mb,
        "convert_anon_within_limit": conv["peak_anon_mb"] <= limit_mb,
        "output_bytes": conv["output_bytes"],
        "quantized_tensors": conv["quantized_tensors"],
    }
    print(f"convert benchmark: {total / 1e9:.2f} GB checkpoint ({args.experts} K3 experts), largest tensor "
          f"{largest / 2**20:.0f} MiB, {r['threads']} threads, load average {r['loadavg_1min']:.1f}")
    for key, label in (("raw_read", "raw read  "), ("raw_copy", "raw copy  "), ("transforms", "transforms"), ("convert", "convert   ")):
        print(f"  {label}  {r[key + '_gbps']:6.3f} GB/s  {r[key + '_s']:7.2f} s  peak RSS {r[key + '_peak_rss_mb']:6.0f} MB "
              f"(anonymous {r[key + '_peak_anon_mb']:.0f}, file-backed {r[key + '_peak_file_mb']:.0f})")
    print(f"  transforms / raw read = {r['transforms_vs_raw_read']:.2f}; convert / raw read = {r['convert_vs_raw_read']:.2f} "
          f"(goal >= 0.5); convert / raw copy = {r['convert_vs_raw_copy']:.2f}")
    print(f"  convert peak RSS limit 2 x largest + 300 MB = "
          f"{limit_mb:.0f} MB: total {'ok' if r['convert_rss_within_limit'] else 'EXCEEDED'}, "
          f"anonymous {'ok' if r['convert_anon_within_limit'] else 'EXCEEDED'} (RSS before work {r['convert_base_rss_mb']:.0f} MB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()

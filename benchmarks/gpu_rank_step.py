"""One K3 rank's decode step and prefill chunk on one GPU (the torch backend's layers and kernels), against the
step's bandwidth bound.

The rank: rank 0 of `h100x64` in its dp layout (tp 8, 8 attention groups, ep 64: 14 of the 896 experts in each of
the 92 MoE layers; all 93 layers at K3's shapes), random weights at their real sizes and dtypes (bf16, MXFP4
experts, fp32 where K3 keeps fp32: about 36 GB), the recipe's fp8 cache pools. A decode step runs B sequences of
the rank's attention group (B = 32 and 256) at 8,192-token contexts; prefill runs one 8,192-token chunk.

No other rank exists, so the collectives are answered locally (`LocalShare`):
  - tp all-reduces return the rank's own partial sum and all-gathers repeat its own part (their bytes on the wire
    are not part of these figures; the README's paper model counts them);
  - the MoE all-to-all is replaced by this rank's own share of the routed tokens at the recipe's expected load:
    every attention group runs the same B (world tokens N = 8 B), routing is uniform over the experts, so a
    dispatch brings this rank R = N d / 64 rows, d = 64 (1 - C(896 - 14, 16) / C(896, 16)) the expected distinct
    ranks per token, carrying N 16 / 64 (token, local expert) pairs spread evenly over its 14 experts (the other
    top-k ids name other ranks' experts, which the expert op skips); the combine adds the R rows' partial sums
    back into the rank's token share.
The bound (`rank_step_bound_ms_32`): bytes one decode step must move, over the read bandwidth measured in the same
run (a sum over 4 GiB): every weight but the embedding table read once (the vocab-parallel lookup reads B rows), the
B sequences' KDA state and conv windows read and written, and their MLA cache rows read (8,192 per sequence and MLA
layer). `tokens_per_s_per_gpu_32` is 32 / step time (the group's 8 GPUs serve those 32 sequences together: per GPU
of the group it is an eighth of that, `tokens_per_s_per_group_gpu_32`). Decode steps are timed replayed from a
CUDA graph, as the runtime decodes (`rank_step_ms_B`), and eager (`rank_step_eager_ms_B`); `cuda_graph_speedup_32`
is eager over replayed at B = 32.

`--smoke` runs the same code on CPU at tiny-k3's sizes (tp 2 x 2 groups, ep 4, 64-token contexts, a 128-token
chunk, bf16 activations as on the GPU, the CPU kernels) so that the script cannot rot; its figures mean nothing. `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from moe_export.common.model_config import ModelConfig
from moe_export.common.mapping import Mapping
from moe_export.graphs.sharding import shard_range
from moe_export.graphs.weights import all_tensor_specs
from moe_export.plugins.collectives.all_to_all import DispatchLayout
from moe_export.recipes import models_dir
from moe_export.recipes.schema import load_recipe
from moe_export.runtime.engine.torch_collectives import AllGather, AllReduce, Combine, Dispatch
from moe_export.runtime.engine.torch_kernels import kernels_for
from moe_export.runtime.engine.torch_model import RankModel, StepInputs
from moe_export.runtime.engine.torch_runner import CACHE_DTYPES, rank_pools

MXFP4_SCALE_BYTE = 121  # E8M0 2^-6: random E2M1 codes (|v| <= 6) times this keep activations in range


class RandomRankWeights:
    """A rank's tensors by name (`RankModel`'s source), random at their sharded shapes, made on the device;
    `read_bytes`: bytes of every tensor but the embedding table (what a decode step reads)."""

    def __init__(self, cfg: ModelConfig, mapping: Mapping, device: torch.device, act: torch.dtype) -> None:
        self.specs = {s.name: s for s in all_tensor_specs(cfg, include_experts=False)}
        self.cfg, self.m, self.device, self.act = cfg, mapping, device, act
        self.gen = torch.Generator(device).manual_seed(0)
        self.read_bytes = 0

    def get(self, name: str, fp32: bool = False) -> torch.Tensor:
        t = self._experts(name) if ".experts.w" in name else self._dense(name, fp32)
        if "embed_tokens" not in name:
            self.read_bytes += t.numel() * t.element_size()
        return t

    def _dense(self, name: str, fp32: bool) -> torch.Tensor:
        spec = self.specs[name]
        shape = list(spec.shape)
        part = shard_range(spec, self.m)
        if part is not None:
            shape[part[0]] = part[2] - part[1]
        dtype = torch.float32 if fp32 or spec.dtype == "F32" else self.act
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if name.endswith("A_log"):
            return t.uniform_(0.0, 2.7, generator=self.gen)
        if "norm" in name and len(shape) == 1:
            return t.fill_(1.0)
        if len(shape) == 1:
            return t.normal_(0.0, 0.02, generator=self.gen)
        return t.normal_(0.0, 1.0 / math.sqrt(math.prod(shape[1:])), generator=self.gen)

    def _experts(self, name: str) -> torch.Tensor:
        cfg = self.cfg
        local, width, inter = len(self.m.local_experts(cfg.num_experts)), cfg.expert_in_dim, cfg.moe_intermediate_size
        rows, cols = (2 * inter, width) if ".w13_" in name else (width, inter)
        if name.endswith("_scale"):
            return torch.full((local, rows, cols // 32), MXFP4_SCALE_BYTE, dtype=torch.uint8, device=self.device)
        return torch.randint(0, 256, (local, rows, cols // 2), dtype=torch.uint8, device=self.device, generator=self.gen)


def expected_rows(cfg: ModelConfig, m: Mapping, world_tokens: int) -> tuple[int, int]:
    """(rows R a dispatch brings this rank, (token, local expert) pairs among them) at uniform routing."""
    e, k, per = cfg.num_experts, cfg.num_experts_per_token, cfg.num_experts // m.ep
    distinct = m.ep * (1 - math.comb(e - per, k) / math.comb(e, k))
    return max(1, round(world_tokens * distinct / m.ep)), max(1, round(world_tokens * k / m.ep))


class LocalShare:
    """Answers a rank's collectives with no other rank (see the module docstring); `plan(group_tokens)` sets the
    step's dispatch to the expected share of dp x group_tokens world tokens."""

    def __init__(self, cfg: ModelConfig, m: Mapping, device: torch.device, act: torch.dtype) -> None:
        self.cfg, self.m, self.device, self.act = cfg, m, device, act

    def plan(self, group_tokens: int) -> None:
        cfg, m, dev = self.cfg, self.m, self.device
        rows, pairs = expected_rows(cfg, m, m.dp * group_tokens)
        local = m.local_experts(cfg.num_experts)
        other = (local.stop % cfg.num_experts) if local.stop < cfg.num_experts else 0  # another rank's expert
        ids = torch.full((rows, cfg.num_experts_per_token), other, dtype=torch.int64)
        j = torch.arange(min(pairs, rows * cfg.num_experts_per_token))
        ids[j % rows, j // rows] = local.start + j % len(local)
        self.received = (torch.randn(rows, cfg.expert_in_dim, device=dev).to(self.act), ids.to(dev),
                         torch.full((rows, cfg.num_experts_per_token), 1.0 / cfg.num_experts_per_token, device=dev),
                         DispatchLayout(None, None, None))  # the combine below needs no layout
        self.rows = rows

    def run(self, step) -> object:
        result = None
        try:
            while True:
                result = self.answer(step.send(result))
        except StopIteration as stop:
            return stop.value

    def answer(self, req) -> object:
        if isinstance(req, AllReduce):
            return req.x
        if isinstance(req, AllGather):
            return torch.cat([req.x] * (self.m.tp if req.group == "tp" else self.m.ep), dim=req.axis)
        if isinstance(req, Dispatch):
            return self.received
        assert isinstance(req, Combine)
        out = torch.zeros(req.num_tokens, req.partial.shape[1], dtype=req.partial.dtype, device=self.device)
        if req.num_tokens:
            back = torch.arange(req.partial.shape[0], device=self.device) % req.num_tokens
            out.index_add_(0, back, req.partial)
        return out


def step_inputs(batch: int, tokens: int, start: int, block_size: int, device: torch.device) -> StepInputs:
    """`batch` sequences (slots 0..B-1) of `tokens` new tokens each from position `start`, each with its own
    contiguous run of blocks."""
    per = -(-(start + tokens) // block_size)
    cu = torch.arange(batch + 1, device=device) * tokens
    tables = torch.arange(batch * per, device=device).view(batch, per)
    positions = (start + torch.arange(tokens, device=device)).repeat(batch)
    return StepInputs(torch.randint(0, 1000, (batch * tokens,), device=device), positions, cu,
                      torch.arange(batch, device=device), tables, cu[1:] - 1)


def timed(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall time of `fn` in ms (device synchronised around each call), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a sum over an `nbytes` bf16 tensor."""
    t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = timed(lambda: t.sum(), device, 5)
    return nbytes / (ms / 1e3)


def step_bytes(model: RankModel, pools: dict, batch: int, context: int, weight_bytes: int) -> int:
    """Bytes a decode step of `batch` sequences at `context` tokens must move (see the module docstring)."""
    state = sum(p[:batch].numel() * p.element_size() for n, p in pools.items() if n.startswith(("kda_state.", "conv_state.")))
    cache = sum(context * batch * p.shape[-1] * p.element_size() for n, p in pools.items() if n.startswith("mla_cache."))
    return weight_bytes + 2 * state + cache


def setup(smoke: bool):
    """(config, mapping, recipe, device, activation dtype, sizes) of the run."""
    if smoke:
        from moe_export.export.synth import preset_config

        torch.set_num_threads(1)  # a shared CPU: one thread (others' spinning threads would starve it)
        cfg, m = preset_config("tiny-k3"), Mapping(4, 0, 2, 4, "dp")
        recipe = load_recipe("tiny-cpu.yaml")[0]
        return cfg, m, recipe, torch.device("cpu"), torch.bfloat16, dict(context=64, chunk=128, iters=2, bw=64 << 20)
    raw = json.loads((models_dir() / "kimi-k3.json").read_text())
    cfg = ModelConfig.from_hf_dict(raw, source="recipes/models/kimi-k3.json")
    recipe = load_recipe("h100x64.yaml")[0]
    p = recipe.parallel
    m = Mapping(recipe.target.world_size, 0, p.tp, p.ep, p.attention)
    return cfg, m, recipe, torch.device("cuda"), torch.bfloat16, dict(context=8192, chunk=8192, iters=5, bw=4 << 30)


def decode_graph(model: RankModel, world: LocalShare, inputs: StepInputs, pools: dict, kernels):
    """A CUDA graph of one decode step; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        world.run(model.step(inputs, pools, kernels))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        world.run(model.step(inputs, pools, kernels))
    return graph.replay


def run(smoke: bool) -> dict:
    cfg, m, recipe, device, act, size = setup(smoke)
    src = RandomRankWeights(cfg, m, device, act)
    cache_dtype = CACHE_DTYPES[recipe.quantization.kv_cache]
    model = RankModel(cfg, m, src, device, act, use_indexer=recipe.attention.indexer == "auto",
                      topk=recipe.attention.sparse_topk or cfg.index_topk or 0, cache_dtype=cache_dtype)
    bs, ctx = recipe.limits.block_size, size["context"]
    big = 256
    pools = rank_pools(model, big, big * -(-(ctx + 1) // bs) + -(-size["chunk"] // bs), bs)
    kernels = kernels_for(device, list(pools.values()))
    world = LocalShare(cfg, m, device, act)
    fig: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "smoke": smoke,
                 "context": ctx, "weight_gib_read_per_step": src.read_bytes / 2**30}

    def step(inputs: StepInputs):
        with torch.no_grad():
            return world.run(model.step(inputs, pools, kernels))

    for batch in (32, big):  # eager, and on a GPU replayed from a CUDA graph as the runtime decodes
        inputs = step_inputs(batch, 1, ctx, bs, device)
        world.plan(batch)
        fig[f"dispatch_rows_{batch}"] = world.rows
        eager = fig[f"rank_step_eager_ms_{batch}"] = timed(lambda: step(inputs), device, size["iters"])
        if device.type == "cuda":
            replay = decode_graph(model, world, inputs, pools, kernels)
            fig[f"rank_step_ms_{batch}"] = timed(replay, device, size["iters"])
            del replay
        else:
            fig[f"rank_step_ms_{batch}"] = eager
    bandwidth = read_bandwidth(device, size["bw"])
    fig["read_bandwidth_gbs"] = bandwidth / 1e9
    fig["rank_step_bound_ms_32"] = step_bytes(model, pools, 32, ctx, src.read_bytes) / bandwidth * 1e3
    fig["rank_step_over_bound_32"] = fig["rank_step_ms_32"] / fig["rank_step_bound_ms_32"]
    fig["tokens_per_s_per_gpu_32"] = 32 / (fig["rank_step_ms_32"] / 1e3)
    fig["tokens_per_s_per_group_gpu_32"] = fig["tokens_per_s_per_gpu_32"] / m.tp
    fig["cuda_graph_speedup_32"] = (fig["rank_step_eager_ms_32"] / fig["rank_step_ms_32"]
                                    if device.type == "cuda" else None)
    chunk = step_inputs(1, size["chunk"], 0, bs, device)
    chunk.tables += big * -(-(ctx + 1) // bs)  # blocks past the decode sequences'
    world.plan(size["chunk"])
    fig["prefill_ms_8k"] = timed(lambda: step(chunk), device, 1, warmup=1)
    fig["prefill_tokens_per_s_8k"] = size["chunk"] / (fig["prefill_ms_8k"] / 1e3)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (keeps the script working; no figures)")
    args = ap.parse_args()
    fig = run(args.smoke)
    text = json.dumps(fig, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Benchmark of the CPU sparse MLA attention, DSA indexer and MXFP4 MoE paths, on 2 threads.

sparse_mla_attention: one decode token, H = 16 heads, latent row 512 + 64 (K3), top-k = 2048 at context
n = 8k, 16k, 64k (the sequence's first n rows of one 64k cache, paged into a bf16 pool of 64-row blocks in shuffled
order with its block table, as the engine stores them; the token sits at position n-1), vs the dense absorbed MLA
over the same cache (the op without indices). Figures: seconds per call, `sparse_speedup_64k` (dense / sparse at 64k)
and `sparse_time_ratio_64k_over_8k` (sparse at 64k / sparse at 8k).
dsa_indexer: one decode token at n = 64k, 64 heads x 128 (DeepSeek-V3.2 sizes), top-2048, keys paged the same way.
moe_mxfp4: a decode step of 4 tokens x top-16 over 256 experts, this rank holding 32 (EP = 8), experts scaled
down from K3's latent 3584 x 3072 to D = 1024, I = 768 (quick: 512 x 384), random MXFP4 bytes, SiTU; the op's
grouped, tiled path vs dequantizing only the local experts the step uses (about 7 of 32) with
`quantize.mxfp4.decode`, each before its matmuls (`moe_speedup_vs_dequant_matmul`). Outputs are checked against each other.
Times are the best of several runs, in seconds: on a shared 2-core machine a descheduled OpenMP thread makes
single runs of millisecond calls 10-50x slower, so the minimum is the stable figure. ``run()`` returns a flat
dict; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from moe_export.plugins.dsa_indexer.cpu import dsa_indexer_cpu
from moe_export.plugins.moe_mxfp4.cpu import group_by_expert, moe_mxfp4_cpu
from moe_export.plugins.moe_mxfp4.reference import gated_activation
from moe_export.plugins.sparse_mla_attention.cpu import sparse_mla_attention_cpu
from moe_export.quantize import mxfp4

THREADS = 2
CONTEXTS = (8192, 16384, 65536)
HEADS, LATENT, ROPE, TOPK = 16, 512, 64, 2048
BLOCK = 64  # cache block size (the recipe default)


def _interleaved_best(calls: dict, rounds: int) -> tuple[dict, dict]:
    """Shortest wall time of each call over `rounds` rounds (one warm-up call each first); the calls are timed
    in turn within every round, so a busy spell of the machine hits all of them alike. -> (times, outputs)."""
    outputs = {name: call() for name, call in calls.items()}
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, outputs


def paged(rows: torch.Tensor, position: int) -> dict:
    """One sequence's cache rows [L, D] as the paged ops take them for a decode token at `position`: a bf16 pool
    (the recipe's default storage) of BLOCK-row blocks in shuffled order, the block table, and the token's own
    row as the step's new row (fp32, rounded to bf16)."""
    blocks = rows.shape[0] // BLOCK
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(3))
    pool = torch.empty(blocks, BLOCK, rows.shape[1], dtype=torch.bfloat16)
    pool[order] = rows.view(blocks, BLOCK, -1).to(torch.bfloat16)
    return dict(pool=pool, new=rows[position : position + 1].bfloat16().float(), cu_seqlens=torch.tensor([0, 1]),
                block_tables=order[None], positions=torch.tensor([position]))


def bench_sparse_mla(rounds: int) -> dict:
    """Sparse (top-2048) vs dense decode of one token at every context n."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(max(CONTEXTS), LATENT + ROPE, generator=gen)
    q = torch.randn(1, HEADS, LATENT + ROPE, generator=gen)
    calls = {}
    for n in CONTEXTS:
        idx = torch.randperm(n, generator=gen)[:TOPK][None]
        c = paged(cache[:n], n - 1)
        attend = functools.partial(sparse_mla_attention_cpu, q, c["pool"], c["new"], c["cu_seqlens"], c["block_tables"],
                                   c["positions"], scale=192**-0.5, kv_lora_rank=LATENT)  # fmt: skip
        calls[f"sparse_mla_decode_s_{n // 1024}k"] = functools.partial(attend, topk_indices=idx)
        calls[f"dense_mla_decode_s_{n // 1024}k"] = attend
    figures, outputs = _interleaved_best(calls, rounds)
    assert all(torch.isfinite(o).all() for o in outputs.values())
    figures["sparse_speedup_64k"] = figures["dense_mla_decode_s_64k"] / figures["sparse_mla_decode_s_64k"]
    figures["sparse_time_ratio_64k_over_8k"] = figures["sparse_mla_decode_s_64k"] / figures["sparse_mla_decode_s_8k"]
    return figures


def bench_indexer(rounds: int) -> dict:
    """Indexer decode of one token over a 64k key cache."""
    gen = torch.Generator().manual_seed(1)
    n, heads, dim = max(CONTEXTS), 64, 128
    c = paged(torch.randn(n, dim, generator=gen), n - 1)
    args = dict(q_idx=torch.randn(1, heads, dim, generator=gen), weights=torch.rand(1, heads, generator=gen),
                k_pool=c["pool"], k_new=c["new"], cu_seqlens=c["cu_seqlens"], block_tables=c["block_tables"],
                positions=c["positions"])  # fmt: skip
    calls = {"dsa_indexer_decode_s_64k": lambda: dsa_indexer_cpu(**args, topk=TOPK)}
    times, outputs = _interleaved_best(calls, rounds)
    assert (outputs["dsa_indexer_decode_s_64k"] >= 0).all()
    return times


def dequantize_used_then_matmul(
    x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset
):
    """Baseline a user would write: decode to fp32 (quantize.mxfp4) only the local experts this step routes
    to, one at a time, then that expert's matmuls (SiTU)."""
    top_k, inter = expert_ids.shape[1], w13_packed.shape[1] // 2
    y = torch.zeros(x.shape[0], x.shape[1])
    pairs, experts, counts = group_by_expert(expert_ids, expert_offset, w13_packed.shape[0])
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        sel = pairs[start : start + n]
        start += n
        tokens = sel // top_k
        h = x[tokens] @ mxfp4.decode(w13_packed[e], w13_scale[e]).T
        act = gated_activation(h[:, :inter], h[:, inter:], "situ", 4.0, 25.0)
        y.index_add_(0, tokens, (act @ mxfp4.decode(w2_packed[e], w2_scale[e]).T) * expert_weights.reshape(-1)[sel, None])
    return y


def bench_moe(rounds: int, quick: bool) -> dict:
    """MoE decode step: the op's CPU path vs decode-used-experts-then-matmul, on the same random MXFP4 experts."""
    gen = torch.Generator().manual_seed(2)
    tokens, top_k, num_global, num_local = 4, 16, 256, 32
    dim, inter = (512, 384) if quick else (1024, 768)

    def rand_mx(rows, cols):
        packed = torch.randint(0, 256, (num_local, rows, cols // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(117, 122, (num_local, rows, cols // 32), generator=gen, dtype=torch.uint8)
        return packed, scales

    w13p, w13s = rand_mx(2 * inter, dim)
    w2p, w2s = rand_mx(dim, inter)
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:top_k] for _ in range(tokens)])
    args = dict(
        x=torch.randn(tokens, dim, generator=gen),
        expert_ids=ids,
        expert_weights=torch.rand(tokens, top_k, generator=gen),
        w13_packed=w13p, w13_scale=w13s, w2_packed=w2p, w2_scale=w2s,
    )  # fmt: skip
    calls = {
        "moe_mxfp4_decode_s": lambda: moe_mxfp4_cpu(**args, expert_offset=0),
        "moe_dequant_used_matmul_decode_s": lambda: dequantize_used_then_matmul(**args, expert_offset=0),
    }
    figures, outputs = _interleaved_best(calls, rounds)
    fast_y, base_y = outputs.values()
    err = float((fast_y - base_y).abs().max()) / max(float(base_y.abs().max()), 1.0)
    assert err < 1e-4, err
    local = (ids >= 0) & (ids < num_local)
    return {
        **figures,
        "moe_speedup_vs_dequant_matmul": figures["moe_dequant_used_matmul_decode_s"] / figures["moe_mxfp4_decode_s"],
        "moe_local_pairs": int(local.sum()),
        "moe_local_experts_used": int(torch.unique(ids[local]).numel()),
    }


def run(quick: bool = False) -> dict:
    """All figures as a flat dict (seconds, ratios, counts)."""
    torch.set_num_threads(THREADS)
    figures = {"threads": THREADS}
    figures.update(bench_sparse_mla(10 if quick else 30))
    figures.update(bench_indexer(5 if quick else 10))
    figures.update(bench_moe(5 if quick else 8, quick))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller MoE experts")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    figures = run(quick=args.quick)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

"""GPU check of the Triton kernels against the hardware and the anchors (one short run on a lent H200; not CI).

Every figure comes with a correctness check at the same shape; a failing check records `<key>_error` and the
others still run. Timings: triton.testing.do_bench (CUDA events, median). Keys (the goals of the GPU-kernel issue):
  - limits, measured in the same run: `read_bw_gbps` (t.sum() over 4 GiB bf16), `bf16_matmul_tflops` (8192^3);
  - KDA, ours (the plugin's path on the state pool, in place at shuffled slots: `gated_delta_scan.fla_path`)
    vs fla (`chunk_kda` for prefill, `fused_recurrent_kda` for decode, on gathered states), bf16 q/k/v, fp32
    state, K = V = 128, our own token-by-token kernel timed beside (`kda_*_triton_ms_*`): `kda_prefill_vs_fla_<N>x<T>_h<H>` at 1 x 8192 H 16 and 16 x 2048 H 8, `kda_prefill_vs_fla` (the
    smaller), `kda_decode_vs_fla_<N>` at 64 and 256 sequences H 12, `kda_decode_vs_fla`; outputs within 4e-3
    (prefill: 2e-2, bf16 outputs over 8k-token chunks) of fla's (`*_max_abs_diff`);
  - MoE W4A16 (one EP rank of K3: 14 experts, D 3584, I 3072; bf16 in and out): `moe_decode_bw_frac_<T>` at
    T = 1 (one pick), 16 and 64 (4 local picks each) = bytes of the experts touched / time / read bandwidth,
    `moe_decode_bw_frac` (the smallest); `moe_prefill_tflops_frac` at T = 4096 = 2 * 3 * D * I per pair / time /
    the bf16 matmul rate; each within 2e-2 relative (of max |y|) of a bf16 per-expert torch loop;
  - sparse MLA decode, 128k cached tokens per sequence, top-2048, 12 heads (96 / tp 8), 576-wide bf16 latent
    rows in a paged pool: `sparse_mla_ms_1` (one sequence), `sparse_mla_bw_frac_64` (64 sequences: selected
    rows' bytes / time / read bandwidth); each within 1e-2 relative (of max |o|: bf16 operands on the tensor
    cores) of a torch gather-and-softmax in fp32;
  - DSA indexer decode over 128k cached bf16 index keys (64 heads x 128): `indexer_bw_frac_128k` (key bytes /
    time / read bandwidth), `indexer_topk_score_ok` (the chosen positions' scores are the top-k by torch);
  - the old figures (`kda_triton_ms`, `moe_triton_ms`, `sparse_128k_ms`, ...) and the no-host-sync CUDA-graph
    capture of the MoE and indexer plugin bodies.
GPU_CHECK_SMOKE=1 (with TRITON_INTERPRET=1, on CPU) runs every check at tiny shapes, our references standing in
for fla, so that the script is known to run before a GPU is lent (tests/test_gpu_check.py).
`--json PATH` writes the figures as one flat object.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import torch
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]

from moe_export.plugins.dsa_indexer.triton_kernel import dsa_indexer_launch
from moe_export.plugins.gated_delta_scan import reference as kda_ref
from moe_export.plugins.gated_delta_scan.fla_path import kda_pool_fla
from moe_export.plugins.gated_delta_scan.triton_kernel import gated_delta_scan_pool
from moe_export.plugins.moe_mxfp4.layout import kernel_experts
from moe_export.plugins.moe_mxfp4.triton_kernel import moe_mxfp4_triton
from moe_export.plugins.pool_table import device_pool_table
from moe_export.plugins.sparse_mla_attention.triton_kernel import sparse_mla_attention_launch
from moe_export.quantize import mxfp4

SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
DEV = "cpu" if SMOKE else "cuda"
# Full shapes (the issue's) and the smoke run's.
SHAPES = {
    "bw_bytes": 4 << 30, "mm": 8192,
    "kda_prefill": [(1, 8192, 16), (16, 2048, 8)], "kda_decode": [64, 256], "kda_decode_h": 12, "kda_k": 128,
    "moe": dict(E=14, D=3584, I=3072), "moe_decode": [1, 16, 64], "moe_prefill": 4096,
    "mla": dict(L=131072, H=12, topk=2048, bs=64, seqs=[1, 64]), "indexer": dict(L=131072, Hi=64, Di=128, topk=2048),
}
if SMOKE:
    SHAPES.update({
        "bw_bytes": 1 << 20, "mm": 64, "kda_prefill": [(1, 24, 2), (2, 8, 2)], "kda_decode": [3], "kda_decode_h": 2,
        "kda_k": 16, "moe": dict(E=6, D=64, I=64), "moe_decode": [1, 4], "moe_prefill": 8,
        "mla": dict(L=256, H=2, topk=16, bs=16, seqs=[1, 2]), "indexer": dict(L=256, Hi=4, Di=16, topk=16),
    })  # fmt: skip


def bench_ms(fn) -> float:
    """Median milliseconds of fn() (CUDA events; smoke: wall time of one call after a warm-up)."""
    if SMOKE:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def within(fig: dict, key: str, diff: float, tol: float) -> None:
    """Record `key` = diff and fail the check (-> `<check>_error`) when it is above `tol`."""
    fig[key] = diff
    if not diff <= tol:
        raise AssertionError(f"{key} = {diff:.3g} > {tol:g}")


def check_limits(fig: dict) -> None:
    x = torch.ones(SHAPES["bw_bytes"] // 2, dtype=torch.bfloat16, device=DEV)
    fig["read_bw_gbps"] = x.numel() * 2 / bench_ms(lambda: x.sum()) / 1e6
    n = SHAPES["mm"]
    a, b = (torch.randn(n, n, device=DEV).to(torch.bfloat16) for _ in range(2))
    fig["bf16_matmul_tflops"] = 2 * n**3 / bench_ms(lambda: a @ b) / 1e9


def _fla():
    """(chunk_kda, fused_recurrent_kda): fla's on the GPU; our reference scan in the smoke run."""
    if SMOKE:
        def ref(q, k, v, g, beta, initial_state=None, cu_seqlens=None, **_):
            return kda_ref.gated_delta_scan(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)  # fmt: skip
        return ref, ref
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return chunk_kda, fused_recurrent_kda


def _kda_case(n: int, t: int, h: int, kd: int):
    """Packed bf16 q, k, v [T, H, K], fp32 g, beta; n sequences of t tokens at shuffled slots of a V-first fp32
    pool [2n, H, V, K]; the same states gathered K-first [n, H, K, V] for fla."""
    q, k, v = (torch.randn(n * t, h, kd, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(n * t, h, kd, device=DEV))
    beta = torch.sigmoid(torch.randn(n * t, h, device=DEV))
    cu = torch.arange(0, n * t + 1, t, device=DEV)
    slots = torch.randperm(2 * n, device=DEV)[:n]
    pool = torch.randn(2 * n, h, kd, kd, device=DEV) * 0.1
    return (q, k, v, g, beta), cu, slots, pool, pool[slots].transpose(-1, -2).contiguous()


def _ours_on_pool(args, work, cu, slots, kd):
    """The plugin's path: fla's kernels on our pool (`fla_path`) on the GPU; our Triton kernel in the smoke run."""
    if SMOKE:
        return gated_delta_scan_pool(*args, work, cu, slots, kd**-0.5, True)
    return kda_pool_fla(*args, work, cu, slots, kd**-0.5, True)


def _check_kda(fig: dict, kind: str, name: str, n: int, t: int, h: int, tol: float) -> float:
    """ours (on the pool, in place) vs fla (gathered states) at n x t tokens, H h; returns fla ms / ours ms."""
    chunk_kda, fused_recurrent_kda = _fla()
    theirs_fn = chunk_kda if kind == "prefill" else fused_recurrent_kda
    kd = SHAPES["kda_k"]
    args, cu, slots, pool, state0 = _kda_case(n, t, h, kd)
    work = pool.clone()
    ours = lambda: _ours_on_pool(args, work, cu, slots, kd)  # noqa: E731
    theirs = lambda: theirs_fn(*(x.unsqueeze(0) for x in args), initial_state=state0, output_final_state=True,  # noqa: E731
                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    fig[f"kda_{kind}_ms_{name}"], fig[f"kda_{kind}_fla_ms_{name}"] = bench_ms(ours), bench_ms(theirs)
    own = lambda: gated_delta_scan_pool(*args, work, cu, slots, kd**-0.5, True)  # noqa: E731
    fig[f"kda_{kind}_triton_ms_{name}"] = bench_ms(own)  # our token-by-token kernel (the AOT / no-fla path)
    work.copy_(pool)
    o, (o_f, s_f) = ours(), theirs()
    diff = max(max_diff(o, o_f[0]), max_diff(work[slots].transpose(-1, -2), s_f))
    within(fig, f"kda_{kind}_max_abs_diff_{name}", diff, tol)
    fig[f"kda_{kind}_vs_fla_{name}"] = fig[f"kda_{kind}_fla_ms_{name}"] / fig[f"kda_{kind}_ms_{name}"]
    return fig[f"kda_{kind}_vs_fla_{name}"]


def check_kda_prefill(fig: dict) -> None:
    ratios = [_check_kda(fig, "prefill", f"{n}x{t}_h{h}", n, t, h, 2e-2) for n, t, h in SHAPES["kda_prefill"]]
    fig["kda_prefill_vs_fla"] = min(ratios)
    n, t, h = SHAPES["kda_prefill"][0]
    name = f"{n}x{t}_h{h}"
    fig["kda_triton_ms"], fig["kda_fla_chunk_ms"] = fig[f"kda_prefill_triton_ms_{name}"], fig[f"kda_prefill_fla_ms_{name}"]
    fig["kda_triton_vs_fla"] = fig["kda_fla_chunk_ms"] / fig["kda_triton_ms"]
    fig["kda_max_abs_diff_vs_fla"] = fig[f"kda_prefill_max_abs_diff_{name}"]


def check_kda_decode(fig: dict) -> None:
    h = SHAPES["kda_decode_h"]
    fig["kda_decode_vs_fla"] = min(_check_kda(fig, "decode", str(n), n, 1, h, 4e-3) for n in SHAPES["kda_decode"])


def _moe_case(T: int, k: int):
    E, D, I = (SHAPES["moe"][x] for x in "EDI")
    gen = torch.Generator().manual_seed(T)
    dev_gen = torch.Generator(DEV).manual_seed(T)  # the experts made and encoded on the device: seconds, not minutes
    w13p, w13s = mxfp4.encode(torch.randn(E, 2 * I, D, generator=dev_gen, device=DEV) / D**0.5)
    w2p, w2s = mxfp4.encode(torch.randn(E, D, I, generator=dev_gen, device=DEV) / I**0.5)
    dense = [mxfp4.decode(p, s).to(DEV, torch.bfloat16) for p, s in ((w13p, w13s), (w2p, w2s))]
    w = [t.to(DEV) for t in kernel_experts(w13p, w13s, w2p, w2s)]  # the layout the kernels read
    x = torch.randn(T, D, generator=gen).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEV)
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1).to(DEV)
    return x, ids, wts, w, dense


def _moe_bf16_loop(x, ids, wts, dense):
    """The baseline: per expert, its tokens' bf16 GEMMs in torch, SiLU gating, weighted sum (fp32)."""
    w13, w2 = dense
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        h = (x[tok] @ w13[e].T).float()
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (a.bfloat16() @ w2[e].T).float() * wts[tok, slot, None])
    return out


def _moe_run(T: int, k: int, fig: dict, name: str):
    x, ids, wts, w, dense = _moe_case(T, k)
    ours = lambda: moe_mxfp4_triton(x, ids, wts, *w, expert_offset=0, activation="silu")  # noqa: E731
    ms = bench_ms(ours)
    want = _moe_bf16_loop(x, ids, wts, dense)
    got = ours()
    within(fig, f"moe_rel_diff_{name}", max_diff(got, want) / max(float(want.abs().max()), 1.0), 2e-2)
    experts = int(torch.unique(ids).numel())
    return ms, experts, lambda: _moe_bf16_loop(x, ids, wts, dense)


def check_moe(fig: dict) -> None:
    E, D, I = (SHAPES["moe"][x] for x in "EDI")
    expert_bytes = 3 * D * I // 2 + 3 * D * I // 32  # packed nibbles + one E8M0 byte per 32 weights
    fracs = []
    for T in SHAPES["moe_decode"]:
        ms, experts, base = _moe_run(T, 1 if T == 1 else 4, fig, f"decode_{T}")
        fig[f"moe_decode_ms_{T}"] = ms
        fig[f"moe_decode_bw_frac_{T}"] = experts * expert_bytes / (ms * 1e-3) / (fig["read_bw_gbps"] * 1e9)
        fracs.append(fig[f"moe_decode_bw_frac_{T}"])
        if T == SHAPES["moe_decode"][-1]:  # the old figures: T = 64 against the bf16 loop
            fig["moe_triton_ms"], fig["moe_bf16_grouped_ms"] = ms, bench_ms(base)
            fig["moe_triton_vs_bf16"] = fig["moe_bf16_grouped_ms"] / ms
            fig["moe_max_abs_diff_vs_bf16"] = fig[f"moe_rel_diff_decode_{T}"]  # relative to max |y| now
    fig["moe_decode_bw_frac"] = min(fracs)
    T = SHAPES["moe_prefill"]
    ms, _, base = _moe_run(T, 4, fig, f"prefill_{T}")
    fig["moe_prefill_ms"], fig["moe_prefill_bf16_loop_ms"] = ms, bench_ms(base)
    fig["moe_prefill_tflops"] = 2 * 3 * D * I * T * 4 / (ms * 1e-3) / 1e12
    fig["moe_prefill_tflops_frac"] = fig["moe_prefill_tflops"] / fig["bf16_matmul_tflops"]


def _paged_pool(seqs: int, L: int, bs: int, width: int):
    """A bf16 paged pool of `seqs` sequences x L positions, shuffled block tables, the step's token at L - 1."""
    blocks = seqs * L // bs
    pool = torch.empty(blocks, bs, width, device=DEV, dtype=torch.bfloat16).normal_()
    tables = torch.randperm(blocks, device=DEV).view(seqs, L // bs)
    return pool, tables, torch.arange(seqs + 1, device=DEV), torch.full((seqs,), L - 1, device=DEV)


def _gathered_rows(pool, tables, positions_per_seq):
    """Rows [N, K, W] fp32 of the pool at each sequence's positions [N, K]."""
    bs = pool.shape[1]
    blocks = torch.gather(tables, 1, positions_per_seq // bs)
    return pool[blocks, positions_per_seq % bs].float()


def check_sparse_mla(fig: dict) -> None:
    L, H, topk, bs = (SHAPES["mla"][x] for x in ("L", "H", "topk", "bs"))
    for n in SHAPES["mla"]["seqs"]:
        pool, tables, cu, pos = _paged_pool(n, L, bs, 576)
        new = pool[tables[:, -1], bs - 1].float()  # the step's own row, as written by the cache write
        q = torch.randn(n, H, 576, device=DEV)
        idx = torch.stack([torch.randperm(L - 1, device=DEV)[: topk - 1] for _ in range(n)])
        idx = torch.cat([idx, pos[:, None]], 1)  # the token itself among the selected
        table = device_pool_table([pool])
        out = torch.empty(n, H, 512, device=DEV)
        run = functools.partial(sparse_mla_attention_launch, q, table, 0, bs, pool.dtype, new, cu, tables, pos, idx, out,
                                scale=192**-0.5, kv_lora_rank=512)
        ms = bench_ms(run)
        run()
        rows = _gathered_rows(pool, tables, idx)  # [N, K, 576]
        p = torch.softmax(torch.einsum("nhd,nkd->nhk", q, rows) * 192**-0.5, -1)
        want = torch.einsum("nhk,nkc->nhc", p, rows[..., :512])
        within(fig, f"sparse_mla_rel_diff_{n}", max_diff(out, want) / max(float(want.abs().max()), 1.0), 1e-2)
        if n == 1:  # and the earlier figures: the dense path (every position) at the same context
            fig["sparse_mla_ms_1"] = fig["sparse_128k_ms"] = ms
            fig["dense_128k_ms"] = bench_ms(functools.partial(sparse_mla_attention_launch,
                q, table, 0, bs, pool.dtype, new, cu, tables, pos, None, out, scale=192**-0.5, kv_lora_rank=512))
            fig["sparse_speedup_128k"] = fig["dense_128k_ms"] / ms
        else:
            fig[f"sparse_mla_ms_{n}"] = ms
            fig[f"sparse_mla_bw_frac_{n}"] = n * topk * 576 * 2 / (ms * 1e-3) / (fig["read_bw_gbps"] * 1e9)


def check_indexer(fig: dict) -> None:
    L, Hi, Di, topk = (SHAPES["indexer"][x] for x in ("L", "Hi", "Di", "topk"))
    bs = 64 if not SMOKE else 16
    pool, tables, cu, pos = _paged_pool(1, L, bs, Di)
    q, w = torch.randn(1, Hi, Di, device=DEV), torch.rand(1, Hi, device=DEV)
    new = pool[tables[:, -1], bs - 1].float()
    table = device_pool_table([pool])
    run = lambda: dsa_indexer_launch(q, w, table, 0, bs, pool.dtype, new, cu, tables, pos, topk=topk)  # noqa: E731
    ms = bench_ms(run)
    fig["indexer_ms_128k"] = ms
    fig["indexer_bw_frac_128k"] = L * Di * 2 / (ms * 1e-3) / (fig["read_bw_gbps"] * 1e9)
    keys = _gathered_rows(pool, tables, torch.arange(L, device=DEV)[None])[0]  # [L, Di]
    scores = (torch.relu(q[0] @ keys.T) * w[0, :, None]).sum(0)
    got = run()[0]
    kth = scores.topk(topk).values[-1]
    fig["indexer_topk_score_ok"] = bool((scores[got] >= kth - 1e-3 * kth.abs().clamp(min=1)).all())
    if not fig["indexer_topk_score_ok"]:
        raise AssertionError("indexer: a chosen position scores below the k-th best")


def check_no_host_sync(fig: dict) -> None:
    """The MoE and DSA indexer plugin bodies under torch's sync debug mode "error" (any device-to-host wait
    raises), captured into a CUDA graph and replayed: equal to the eager run."""
    x, ids, wts, w, _ = _moe_case(16, 4)
    moe = lambda: moe_mxfp4_triton(x, ids, wts, *w, expert_offset=0)  # noqa: E731
    pool, tables, cu, pos = _paged_pool(1, 4096, 64, 128)
    q, wi, new = torch.randn(1, 64, 128, device=DEV), torch.rand(1, 64, device=DEV), torch.randn(1, 128, device=DEV)
    table = device_pool_table([pool])
    indexer = lambda: dsa_indexer_launch(q, wi, table, 0, 64, pool.dtype, new, cu, tables, pos, topk=256)  # noqa: E731
    for name, fn in (("moe", moe), ("indexer", indexer)):
        want = fn().clone()  # warm-up (Triton compiles outside the checked region)
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                got = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph.replay()
        torch.cuda.synchronize()
        fig[f"{name}_no_host_sync_graph_replay_equal"] = bool(torch.equal(got, want))


CHECKS = [check_limits, check_kda_prefill, check_kda_decode, check_moe, check_sparse_mla, check_indexer]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    fig = Figures(args.json, gpu_check_smoke=SMOKE)  # written after every check: a timeout keeps what was measured
    with fig.stage("kernels_device"):
        fig["device"] = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    for check in CHECKS + ([] if SMOKE else [check_no_host_sync]):
        with fig.stage(check.__name__.removeprefix("check_")):
            check(fig)
        if not SMOKE and torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The pool plugins' JIT `impl` bodies (what TensorRT calls at run time), run on CPU in Triton's interpreter.

Run by `test_tensorrt_plugins.py` in a subprocess per pinned TensorRT version (env MOE_EXPORT_TRT_VERSION) with
TRITON_INTERPRET=1; the file name has no `test_` prefix so the main run does not collect it. The registered impl
functions of GatedDeltaScan, ShortConv, PagedCacheWrite, SparseMLAAttention and DSAIndexer are called the way
TensorRT's QDP layer calls them (inputs, the fields as the ONNX parser encodes them, outputs, stream), with the
pools reached only through a pool table of host addresses (two pools, the op's at row 1), against the naive
references. Faked: `as_torch` returns the CPU tensor it is given (on a GPU it views TensorRT's device buffer) and
TensorRT's stream is no stream (the interpreter runs on the host). MoEMXFP4's impl is run too, with and without
a dispatch pending on the ep communicator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tensorrt_standin as standin  # noqa: E402
from fp32_reorder import BF16_U, CONV_RTOL, reorder_atol, scan_rtol  # noqa: E402

VERSION = os.environ.get("MOE_EXPORT_TRT_VERSION", "")
assert VERSION in standin.PINNED_WHEELS, f"MOE_EXPORT_TRT_VERSION={VERSION!r}: run via test_tensorrt_plugins.py"
assert os.environ.get("TRITON_INTERPRET") == "1", "run via test_tensorrt_plugins.py (TRITON_INTERPRET=1)"
trt, trtp = standin.install(VERSION)

from moe_export.export.backends.tensorrt.engine import register_plugins  # noqa: E402
from moe_export.plugins import DOMAIN  # noqa: E402
from moe_export.plugins.pool_table import device_pool_table  # noqa: E402

register_plugins()
QDP = sys.modules["tensorrt.plugin._lib"].QDP_REGISTRY
POOL_OPS = ("short_conv", "gated_delta_scan", "sparse_mla_attention", "dsa_indexer", "paged_cache_write")


@pytest.fixture(autouse=True)
def host_buffers(monkeypatch):
    for folder in POOL_OPS:
        monkeypatch.setattr(sys.modules[f"moe_export.plugins.{folder}.tensorrt_plugin"], "as_torch", lambda t: t)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def impl(op: str):
    return QDP[f"{DOMAIN}::{op}"].impl_func


def i32(v: int) -> np.ndarray:  # an INT attribute as the parser hands it (one INT32)
    return np.array([v], np.int32)


def f32(v: float) -> np.ndarray:
    return np.array([v], np.float32)


def two_pools(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table with a decoy pool at row 0 and `pool` at row 1, the decoy, a copy of the decoy)."""
    decoy = torch.full_like(pool, 7)
    return device_pool_table([decoy, pool]), decoy, decoy.clone()


GEN = torch.Generator().manual_seed(0)
CU = torch.tensor([0, 4, 5])  # a 4-token chunk and one decode token
SLOTS = torch.tensor([3, 1])


def test_short_conv_impl_updates_its_pool_through_the_table():
    from moe_export.plugins.short_conv import reference

    T, C, W, S = 5, 6, 4, 5
    x, w = torch.randn(T, C, generator=GEN), torch.randn(C, W, generator=GEN)
    pool = torch.randn(S, C, W - 1, generator=GEN)
    y_ref, pool_ref = reference.short_conv_node(x, w, pool.clone(), CU, SLOTS)
    table, decoy, decoy0 = two_pools(pool)
    y = torch.empty_like(x)
    impl("ShortConv")(x, w, table, CU, SLOTS, i32(1), outputs=[y], stream=0)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=CONV_RTOL * float(y_ref.abs().max()))  # W-tap fp32 reorder
    assert torch.equal(pool, pool_ref)  # the window is the last W - 1 inputs, copied
    assert torch.equal(decoy, decoy0)


def test_gated_delta_scan_impl_updates_its_pool_through_the_table():
    from moe_export.plugins.gated_delta_scan import reference

    T, H, K, V, S = 5, 2, 8, 8, 5
    q, k = torch.randn(T, H, K, generator=GEN), torch.randn(T, H, K, generator=GEN)
    v = torch.randn(T, H, V, generator=GEN)
    g = -torch.rand(T, H, K, generator=GEN)
    beta = torch.rand(T, H, generator=GEN)
    pool = torch.randn(S, H, V, K, generator=GEN)
    o_ref, pool_ref = reference.gated_delta_scan_node(q, k, v, g, beta, pool.clone(), CU, SLOTS, scale=0.25,
                                                      use_qk_l2norm=True)  # fmt: skip
    table, decoy, decoy0 = two_pools(pool)
    o = torch.empty_like(v)
    impl("GatedDeltaScan")(q, k, v, g, beta, table, CU, SLOTS, f32(0.25), i32(1), i32(1), outputs=[o], stream=0)
    tol = scan_rtol(T, K, V)  # a T-token scan of [K, V] states in another float32 order
    torch.testing.assert_close(o, o_ref, rtol=0, atol=tol * float(o_ref.abs().max()))
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=tol * float(pool_ref.abs().max()))
    assert torch.equal(decoy, decoy0)


BS, B, NB = 8, 3, 6
TABLES = torch.tensor([[4, 0, 2], [5, 1, 3]])
POSITIONS = torch.tensor([5, 6, 7, 8, 20])  # chunk at 5..8 (0..4 in the pool), decode at 20


def test_paged_cache_write_impl_writes_fp8_rows_through_the_table():
    from moe_export.plugins.paged_cache_write import reference
    from moe_export.quantize import fp8_cache

    D = 24
    new = fp8_cache.round_rows(torch.randn(5, D, generator=GEN) * 3)
    pool = torch.randint(0, 256, (NB, BS, D + 1), generator=GEN, dtype=torch.uint8)
    want = reference.paged_cache_write_reference(pool, new, CU, TABLES, POSITIONS)
    table, decoy, decoy0 = two_pools(pool)
    rows = torch.empty_like(new)
    impl("PagedCacheWrite")(table, new, CU, TABLES, POSITIONS, i32(1), i32(BS), "fp8\0", outputs=[rows], stream=0)
    assert torch.equal(pool, want) and torch.equal(rows, new) and torch.equal(decoy, decoy0)


@pytest.mark.parametrize("sparse", [True, False])
def test_sparse_mla_impl_reads_its_pool_through_the_table(sparse):
    from moe_export.plugins.sparse_mla_attention import reference

    H, DC, DR = 3, 16, 16
    q = torch.randn(5, H, DC + DR, generator=GEN)
    pool = torch.randn(NB, BS, DC + DR, generator=GEN)
    new = torch.randn(5, DC + DR, generator=GEN)
    idx = torch.stack([torch.randperm(int(p) + 1, generator=GEN)[:4] for p in POSITIONS]) if sparse else \
        torch.zeros(5, 0, dtype=torch.int64)  # fmt: skip
    want = reference.sparse_mla_attention_reference(q, pool, new, CU, TABLES, POSITIONS, idx if sparse else None,
                                                    scale=0.3, kv_lora_rank=DC)  # fmt: skip
    table, decoy, _ = two_pools(pool)
    decoy.fill_(float("nan"))  # read by mistake, it would poison the result
    out = torch.empty(5, H, DC)
    impl("SparseMLAAttention")(q, table, new, CU, TABLES, POSITIONS, idx, f32(0.3), i32(DC), i32(1), i32(BS), "fp32\0",
                               outputs=[out], stream=0)  # fmt: skip
    # one attention layer in another float32 order, its longest sum over DC + DR (scores) or the 21 positions
    torch.testing.assert_close(out, want, rtol=0, atol=reorder_atol(want.numpy(), 1, max(DC + DR, int(POSITIONS.max()) + 1)))


def test_dsa_indexer_impl_reads_its_key_pool_through_the_table():
    from moe_export.plugins.dsa_indexer import reference
    from moe_export.plugins.dsa_indexer.sizes import workspace_bytes

    Hi, Di, topk = 4, 16, 6
    q = torch.randn(5, Hi, Di, generator=GEN)
    w = torch.rand(5, Hi, generator=GEN)
    pool = torch.randn(NB, BS, Di, generator=GEN)
    new = torch.randn(5, Di, generator=GEN)
    want = reference.dsa_indexer_reference(q, w, pool, new, CU, TABLES, POSITIONS, topk=topk)
    table, decoy, _ = two_pools(pool)
    decoy.fill_(float("nan"))
    size = workspace_bytes(5, B * BS, topk)
    out, scratch = torch.empty(5, topk, dtype=torch.int64), torch.empty(size, dtype=torch.int8)
    impl("DSAIndexer")(q, w, table, new, CU, TABLES, POSITIONS, i32(topk), i32(size), i32(1), i32(BS), "fp32\0",
                       outputs=[out, scratch], stream=0)  # fmt: skip
    assert torch.equal(out, want)


def test_moe_mxfp4_impl_computes_the_rows_received_after_a_dispatch_and_every_row_otherwise(monkeypatch):
    """MoEMXFP4's impl with its row counts (input 7): while the ep communicator has a dispatch pending
    (`recv_bound`), only the first sum(row_counts) rows are computed, in bf16 (the rest of the output keeps what
    it held); with none pending (the all-reduce layout) every row is. Against the fp32 reference."""
    from moe_export.plugins.collectives import nccl
    from moe_export.plugins.moe_mxfp4 import layout, reference, sizes
    from moe_export.quantize import mxfp4

    monkeypatch.setattr(sys.modules["moe_export.plugins.moe_mxfp4.tensorrt_plugin"], "as_torch", lambda t: t)
    rows, k, dim, inter, local, offset = 12, 2, 64, 32, 3, 3
    x = torch.randn(rows, dim, generator=GEN).bfloat16()
    ids = torch.randint(0, 8, (rows, k), generator=GEN)
    w = torch.rand(rows, k, generator=GEN)
    w13, s13 = mxfp4.encode(torch.randn(local, 2 * inter, dim, generator=GEN) * 0.1)
    w2, s2 = mxfp4.encode(torch.randn(local, dim, inter, generator=GEN) * 0.1)
    weights = [t.view(torch.int8) for t in layout.kernel_experts(w13, s13, w2, s2)]  # as the engine holds them, INT8
    counts = torch.tensor([3, 0, 4])  # 7 rows received from 3 sources
    scratch = torch.zeros(sizes.workspace_bytes(rows, k, dim, inter, local), dtype=torch.int8)
    fields = (i32(offset), "situ\0", f32(4.0), f32(25.0), i32(scratch.numel()))
    want = reference.moe_mxfp4_reference(x.float(), ids, w, w13, s13, w2, s2, expert_offset=offset)
    comm = types.SimpleNamespace(recv_bound=9)  # the host's bound: at least the 7 rows, less than the buffer
    monkeypatch.setattr(nccl, "_communicators", {"ep": comm})
    # bf16 compute over the same bf16 x and decoded weights: gate, up and their product each rounded (3u relative
    # on the activation), carried through w2's inter-term sum (sum|terms| <= sqrt(inter) |y| for these random signs),
    # and the output rounded (u): (3 sqrt(inter) + 1) u at the scale of max|y|
    atol = (3 * inter**0.5 + 1) * BF16_U * float(want.abs().max())
    y = torch.full((rows, dim), float("nan"), dtype=torch.bfloat16)
    impl("MoEMXFP4")(x, ids, w, *weights, counts, *fields, outputs=[y, scratch], stream=0)
    assert torch.allclose(y[:7].float(), want[:7], atol=atol, rtol=0) and torch.isnan(y[7:].float()).all()
    comm.recv_bound = None  # no dispatch pending: every row
    impl("MoEMXFP4")(x, ids, w, *weights, counts, *fields, outputs=[y, scratch], stream=0)
    assert torch.allclose(y.float(), want, atol=atol, rtol=0)

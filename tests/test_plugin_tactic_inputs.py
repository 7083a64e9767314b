"""The Triton kernels stay inside their buffers when their index inputs hold garbage.

TensorRT may execute a plugin while it times tactics, with unspecified contents in every input: the
kernels that index by `cu_seqlens`, `slot_ids` and `positions` (GatedDeltaScan, ShortConv,
SparseMLAAttention, PagedCacheWrite, also launched by the AOT plugins) clamp them (their launch functions, the
plugins' path, not the host-checking wrappers, which refuse such offsets before launching). Each case surrounds the buffers with
sentinel-filled guard regions (the tensors are views into larger buffers) and checks that nothing outside
the addressed data changed and that every output is finite. Runs in the Triton interpreter (subprocess).
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_triton_inner_tests
from moe_export.plugins.pool_table import device_pool_table

inner_triton = pytest.mark.triton_inner
GUARD = 64
SENTINEL = 12345.0


def guarded(shape, fill):
    """A contiguous tensor of `shape` inside a buffer with GUARD sentinel elements on each side."""
    n = 1
    for d in shape:
        n *= d
    buf = torch.full((n + 2 * GUARD,), SENTINEL)
    body = buf[GUARD : GUARD + n].view(*shape)
    body.copy_(fill)
    return buf, body


def guards_intact(buf):
    return bool((buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all())


def garbage_indices(gen, n, low, high):
    return torch.randint(low, high, (n,), generator=gen, dtype=torch.int64)


def test_triton_in_interpreter_subprocess():
    run_triton_inner_tests(__file__)


@inner_triton
def test_inner_triton_gated_delta_scan_garbage_indices():
    from moe_export.plugins.gated_delta_scan import triton_kernel

    gen = torch.Generator().manual_seed(0)
    T, H, K, V, S, N = 6, 2, 16, 16, 3, 4
    q, k = (torch.randn(T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(T, H, V, generator=gen)
    g = -torch.rand(T, H, K, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    pool_buf, pool = guarded((S, H, V, K), torch.randn(S, H, V, K, generator=gen))
    o_buf, o = guarded((T, H, V), torch.zeros(T, H, V))
    cu = garbage_indices(gen, N + 1, -1000, 1000)
    slots = garbage_indices(gen, N, -50, 50)
    triton_kernel.launch(q, k, v, g, beta, device_pool_table([pool]), 0, cu, slots, o, 0.25, True, True)
    assert guards_intact(pool_buf) and guards_intact(o_buf)
    assert torch.isfinite(pool).all() and torch.isfinite(o).all()


@inner_triton
def test_inner_triton_short_conv_garbage_indices():
    from moe_export.plugins.short_conv import triton_kernel

    gen = torch.Generator().manual_seed(1)
    T, C, W, S, N = 7, 8, 4, 3, 4
    x = torch.randn(T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    pool_buf, pool = guarded((S, C, W - 1), torch.randn(S, C, W - 1, generator=gen))
    y_buf, y = guarded((T, C), torch.zeros(T, C))
    cu = garbage_indices(gen, N + 1, -1000, 1000)
    slots = garbage_indices(gen, N, -50, 50)
    triton_kernel.launch(x, weight, device_pool_table([pool]), 0, cu, slots, y)
    assert guards_intact(pool_buf) and guards_intact(y_buf)
    assert torch.isfinite(pool).all() and torch.isfinite(y).all()


@inner_triton
@pytest.mark.parametrize("sparse", [False, True])
def test_inner_triton_sparse_mla_garbage_indices(sparse):
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    gen = torch.Generator().manual_seed(2)
    T, H, DC, DR, NB, BS, B, N = 5, 4, 16, 16, 3, 4, 2, 3
    q = torch.randn(T, H, DC + DR, generator=gen)
    pool_buf, pool = guarded((NB, BS, DC + DR), torch.randn(NB, BS, DC + DR, generator=gen))
    new_buf, new = guarded((T, DC + DR), torch.randn(T, DC + DR, generator=gen))
    cu = garbage_indices(gen, N + 1, -1000, 1000)
    tables = torch.randint(-500, 500, (N, B), generator=gen)
    pos = garbage_indices(gen, T, -5000, 5000)
    idx = torch.randint(-5000, 5000, (T, 6), generator=gen) if sparse else None
    out = torch.empty(T, H, DC)
    triton_kernel.sparse_mla_attention_launch(q, device_pool_table([pool]), 0, BS, pool.dtype, new, cu, tables, pos, idx,
                                              out, scale=0.1, kv_lora_rank=DC)  # fmt: skip
    assert guards_intact(pool_buf) and guards_intact(new_buf)
    assert torch.isfinite(out).all()


@inner_triton
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.uint8])
def test_inner_triton_paged_cache_write_garbage_indices(pool_dtype):
    """The one kernel that writes into a pool: garbage positions, tables and cu_seqlens keep every store inside the
    pool (uint8: fp8 rows of D + 1 bytes)."""
    from moe_export.plugins.paged_cache_write import triton_kernel

    gen = torch.Generator().manual_seed(3)
    T, D, NB, BS, B, N = 6, 24, 3, 4, 2, 3
    width = D + (pool_dtype == torch.uint8)
    buf = torch.full((NB * BS * width + 2 * GUARD,), 77, dtype=pool_dtype)
    pool = buf[GUARD : GUARD + NB * BS * width].view(NB, BS, width)
    new = torch.randn(T, D, generator=gen)
    cu = garbage_indices(gen, N + 1, -1000, 1000)
    tables = torch.randint(-500, 500, (N, B), generator=gen)
    pos = garbage_indices(gen, T, -5000, 5000)
    width_rows = torch.empty_like(new)
    triton_kernel.paged_cache_write_launch(device_pool_table([pool]), 0, BS, pool_dtype, new, cu, tables, pos,
                                           width_rows)  # fmt: skip
    assert (buf[:GUARD] == 77).all() and (buf[-GUARD:] == 77).all()

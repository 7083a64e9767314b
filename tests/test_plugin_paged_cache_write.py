"""PagedCacheWrite: reference, fast CPU (the ORT engine's write-back), Triton (interpreter) and the ONNX schema.

The pools come from `conftest.page_cache` (earlier rows in shuffled blocks, NaN everywhere else), so a write to
the wrong row or a touched neighbour shows. fp8 pools are checked against torch's float8_e4m3fn rounding
(through `fp8_cache`), which the Triton kernel re-implements in bit arithmetic.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.plugins.paged_cache_write import cpu, onnx_schema, reference
from moe_export.plugins.paged_cache_write import triton_kernel as write_triton  # TRITON_INTERPRET=1 in triton_inner runs
from moe_export.quantize import fp8_cache
from conftest import page_cache, run_triton_inner_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}


def make_case(seed=0, D=40, L=48, slots=(3, 0, 2), starts=(0, 20, 47), lengths=(5, 1, 1), S=4, block_size=8,
              dtype=torch.float32):  # fmt: skip
    """(pool, new_rows, cu_seqlens, block_tables, positions): sequences with lengths[n] new tokens at positions
    starts[n].., random rows scaled over many magnitudes, paged by `page_cache`."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(S, L, D, generator=gen) * torch.exp2(torch.randint(-20, 8, (S, L, 1), generator=gen).float())
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(torch.int64)
    pool, new, tables = page_cache(cache, torch.tensor(slots), cu, positions, block_size, seed, dtype)
    return pool, new, cu, tables, positions


CASES = {
    "prefill_decode_mix": dict(),
    "chunked_prefill": dict(slots=(1, 3), starts=(10, 0), lengths=(7, 9)),
    "block_size_1": dict(block_size=1),
    "one_block": dict(block_size=64),
    "empty_sequence": dict(slots=(2, 1, 0), starts=(3, 0, 5), lengths=(2, 0, 3), S=3),
}


def decoded(pool: torch.Tensor) -> torch.Tensor:
    return fp8_cache.decode_rows(pool) if pool.dtype == torch.uint8 else pool.float()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal pools (NaN rows included)."""
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a, b.view(torch.uint8) if b.dtype != torch.uint8 else b)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_reference_writes_exactly_the_tokens_rows(name, dtype):
    pool, new, cu, tables, positions = make_case(seed=1, dtype=DTYPES[dtype], **CASES[name])
    out = reference.paged_cache_write_reference(pool, new, cu, tables, positions)
    rows = cpu.cache_rows(cu, tables, positions, pool.shape[1])
    flat_in, flat_out = decoded(pool).view(-1, new.shape[1]), decoded(out).view(-1, new.shape[1])
    assert torch.equal(flat_out[rows], new)  # new rows are already rounded to the storage: stored exactly
    untouched = torch.ones(flat_in.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(flat_out[untouched].nan_to_num(7.0), flat_in[untouched].nan_to_num(7.0))
    assert flat_in[untouched].isnan().any()  # the NaN filler is there to be disturbed


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_in_place_equals_reference(name, dtype):
    pool, new, cu, tables, positions = make_case(seed=2, dtype=DTYPES[dtype], **CASES[name])
    want = reference.paged_cache_write_reference(pool, new, cu, tables, positions)
    got = cpu.paged_cache_write_(pool, new, cu, tables, positions)
    assert got.data_ptr() == pool.data_ptr() and same(got, want)


def test_schema_checker_and_strict_shape_inference():
    onnx_schema.register()
    inputs = [
        helper.make_tensor_value_info("pool_table", TensorProto.INT64, ["P", 3]),
        helper.make_tensor_value_info("new_rows", TensorProto.FLOAT, ["T", 40]),
        helper.make_tensor_value_info("cu_seqlens", TensorProto.INT64, ["N1"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["N", "B"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
    ]
    node = onnx_schema.make_node(*[i.name for i in inputs], "rows_out", pool=0, block_size=64, pool_dtype="fp8")
    graph = helper.make_graph([node], "write", inputs, [helper.make_tensor_value_info("rows_out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    out = inferred.graph.output[0].type.tensor_type
    assert out.elem_type == TensorProto.FLOAT and [d.dim_param or d.dim_value for d in out.shape.dim] == ["T", 40]


def test_aot_compile_produces_ptx():
    """The kernel the TensorRT AOT plugin embeds compiles to sm_90 PTX for K3's latent rows (576 values) in every
    pool dtype; parameters: five input pointers (the pool table first: no pool pointer), the int32 scalars
    pool, N, T, BS, B, the rows_out pointer."""
    for pool_dtype in DTYPES.values():
        kernel = write_triton.aot_compile(576, 90, pool_dtype)
        ptx = kernel.asm["ptx"]
        entry = ptx[ptx.index(".entry _paged_cache_write_kernel(") :].split(")", 1)[0]
        kinds = [".u64 .ptr" if ".ptr" in line else line.split()[1] for line in entry.splitlines() if ".param" in line]
        assert kinds[:11] == [".u64 .ptr"] * 5 + [".u32"] * 5 + [".u64 .ptr"] and ".target sm_90" in ptx
    assert "tensorrt" not in sys.modules


def test_pool_table_guard_refuses_garbage_before_launching():
    """A null or misaligned pool address, a check word that does not match, a capacity of 0,
    a row or a block beyond the pool are clear errors before any kernel is launched (on this machine without
    TRITON_INTERPRET a launch on CPU tensors would fail with another error)."""
    from moe_export.plugins.pool_table import PoolTableError, check_pool_offsets, check_pool_table, table_row

    pool, new, cu, tables, positions = make_case(seed=8, dtype=torch.float32, **CASES[list(CASES)[0]])
    address, blocks = pool.data_ptr(), pool.shape[0]
    for table, message in (([table_row(0, blocks)], "null pool address"),
                           ([table_row(address + 4, blocks)], "not 16-byte aligned"),
                           ([[address, blocks, 0]], "check word"),
                           ([table_row(address, 0)], "capacity 0")):
        with pytest.raises(PoolTableError, match=message):
            check_pool_table(np.array(table, dtype=np.int64))
    good = np.array([table_row(address, blocks)], dtype=np.int64)
    with pytest.raises(PoolTableError, match="the pool table has 1 rows"):
        check_pool_offsets(good, 1)
    with pytest.raises(PoolTableError, match=f"block ids .*{blocks} outside its {blocks} blocks"):
        write_triton.paged_cache_write_triton(pool, new, cu, tables.clone().fill_(blocks), positions)
    misaligned = torch.zeros(pool.numel() + 1)[1:].view(pool.shape)  # 4 bytes past an allocation's start
    with pytest.raises(PoolTableError, match="not 16-byte aligned"):
        write_triton.paged_cache_write_triton(misaligned, new, cu, tables, positions)


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


@inner_triton
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_inner_triton_matches_reference(name, dtype):
    pool, new, cu, tables, positions = make_case(seed=3, dtype=DTYPES[dtype], **CASES[name])
    want = reference.paged_cache_write_reference(pool, new, cu, tables, positions)
    got = write_triton.paged_cache_write_triton(pool, new, cu, tables, positions)
    assert got.data_ptr() == pool.data_ptr() and same(got, want)


@inner_triton
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inner_triton_writes_through_the_pool_table(dtype):
    """The kernel gets no pool argument, only the pool table (here two pools; the write goes
    to row 1's pool, in place, and row 0's stays as it was) and passes the rows on as its output."""
    from moe_export.plugins.pool_table import device_pool_table

    pool, new, cu, tables, positions = make_case(seed=6, dtype=DTYPES[dtype], **CASES[list(CASES)[0]])
    other = pool.clone()
    other_before = other.clone()
    want = reference.paged_cache_write_reference(pool, new, cu, tables, positions)
    rows_out = torch.empty_like(new)
    table = device_pool_table([other, pool])
    write_triton.paged_cache_write_launch(table, 1, pool.shape[1], pool.dtype, new, cu, tables, positions, rows_out)
    assert same(pool, want) and same(other, other_before) and torch.equal(rows_out, new)


@inner_triton
def test_inner_triton_garbage_table_touches_no_pool():
    """TensorRT times tactics on garbage inputs: a table row whose check word does not match (here a real pool
    address with a wrong check word, and a null row) makes the kernel write nothing; the rows are still passed on."""
    import triton

    from moe_export.plugins.pool_table import TRITON_DTYPES, table_row

    pool, new, cu, tables, positions = make_case(seed=7, dtype=torch.float32, **CASES[list(CASES)[0]])
    before = pool.clone()
    for row in ([pool.data_ptr(), pool.shape[0], 12345], [0, 0, 0]):
        rows_out = torch.zeros_like(new)
        write_triton._paged_cache_write_kernel[(new.shape[0],)](
            torch.tensor([row], dtype=torch.int64), new, cu, tables, positions, 0, cu.numel() - 1, new.shape[0],
            pool.shape[1], tables.shape[1], rows_out, D=new.shape[1], BLOCK_D=triton.next_power_of_2(new.shape[1]),
            POOL_FP8=False, POOL_DTYPE=TRITON_DTYPES[torch.float32])  # fmt: skip
        assert same(pool, before) and torch.equal(rows_out, new)
    good = torch.tensor([table_row(pool.data_ptr(), pool.shape[0])], dtype=torch.int64)
    write_triton._paged_cache_write_kernel[(new.shape[0],)](
        good, new, cu, tables, positions, 0, cu.numel() - 1, new.shape[0], pool.shape[1], tables.shape[1], rows_out,
        D=new.shape[1], BLOCK_D=triton.next_power_of_2(new.shape[1]), POOL_FP8=False,
        POOL_DTYPE=TRITON_DTYPES[torch.float32])  # fmt: skip
    assert same(pool, reference.paged_cache_write_reference(before, new, cu, tables, positions))


@inner_triton
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inner_triton_minus_one_table_entry_writes_nothing(dtype):
    """A token whose block-table entry is -1 (the padding rows of the TensorRT runner's decode CUDA graphs)
    writes no row; the others are written as usual."""
    pool, new, cu, tables, positions = make_case(seed=5, dtype=DTYPES[dtype], **CASES[list(CASES)[0]])
    first = int(cu[1])  # the first sequence's tokens get no block
    want = reference.paged_cache_write_reference(pool.clone(), new[first:], cu[1:] - first, tables[1:],
                                                 positions[first:])  # fmt: skip
    tables = tables.clone()
    tables[0] = -1
    got = write_triton.paged_cache_write_triton(pool, new, cu, tables, positions)
    assert same(got, want)


@inner_triton
def test_inner_triton_e4m3_rounding_matches_torch():
    """The kernel's bit-arithmetic E4M3 rounding equals torch's float8_e4m3fn conversion (round to nearest even)
    on random values over the whole range, every code, and every midpoint between neighbouring codes (the ties)."""
    import triton
    import triton.language as tl

    @triton.jit
    def encode(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, write_triton.f32_to_e4m3(x).to(tl.uint8), mask=offs < n)

    gen = torch.Generator().manual_seed(4)
    values = torch.from_numpy(fp8_cache.code_table())
    values = values[values.isfinite()].sort().values
    middles = (values[1:].double() + values[:-1].double()) / 2
    x = torch.cat([values, middles.float(), (torch.rand(200_000, generator=gen) * 2 - 1) * 448,
                   torch.randn(200_000, generator=gen) * torch.exp2(torch.randint(-12, 0, (200_000,), generator=gen).float())])
    out = torch.empty(x.shape[0], dtype=torch.uint8)
    encode[(triton.cdiv(x.shape[0], 1024),)](x, out, x.shape[0], BLOCK=1024)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))

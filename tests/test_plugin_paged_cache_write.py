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
        helper.make_tensor_value_info("pool", TensorProto.UINT8, ["NB", "BS", 41]),
        helper.make_tensor_value_info("new_rows", TensorProto.FLOAT, ["T", 40]),
        helper.make_tensor_value_info("cu_seqlens", TensorProto.INT64, ["N1"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["N", "B"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
    ]
    node = onnx_schema.make_node(*[i.name for i in inputs], "pool_out")
    graph = helper.make_graph([node], "write", inputs, [helper.make_tensor_value_info("pool_out", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    out = inferred.graph.output[0].type.tensor_type
    assert out.elem_type == TensorProto.UINT8 and [d.dim_param or d.dim_value for d in out.shape.dim] == ["NB", "BS", 41]


def test_aot_compile_produces_ptx():
    """The kernel the TensorRT AOT plugin embeds compiles to sm_90 PTX for K3's latent rows (576 values) in every
    pool dtype; parameters: five input pointers, the int32 scalars N, T, NB, BS, B, the output pointer."""
    for pool_dtype in DTYPES.values():
        kernel = write_triton.aot_compile(576, 90, pool_dtype)
        ptx = kernel.asm["ptx"]
        entry = ptx[ptx.index(".entry _paged_cache_write_kernel(") :].split(")", 1)[0]
        kinds = [".u64 .ptr" if ".ptr" in line else line.split()[1] for line in entry.splitlines() if ".param" in line]
        assert kinds[:11] == [".u64 .ptr"] * 5 + [".u32"] * 5 + [".u64 .ptr"] and ".target sm_90" in ptx
    assert "tensorrt" not in sys.modules


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

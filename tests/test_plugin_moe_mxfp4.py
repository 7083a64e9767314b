"""moe_mxfp4: reference vs an independent oracle (decode every expert with quantize.mxfp4, then dense matmuls
with the activation written from the spec), and the CPU, Triton (interpreter, in a subprocess) and ONNX
Runtime implementations vs the reference."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.plugins.moe_mxfp4 import cpu, layout, onnx_schema, ort, reference
from moe_export.quantize import mxfp4
from conftest import run_triton_inner_tests

REPO = Path(__file__).resolve().parents[1]


def close(a, b, tol=1e-5):
    """Max abs error relative to max(1, the reference's max magnitude)."""
    err = float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1.0)
    assert err < tol, err


def make_case(seed=0, T=7, k=3, E=5, D=64, I=96, offset=4, num_global=16, gain=3.0):
    """x [T, D], global expert_ids [T, k] in [0, num_global) (some on this rank: offset..offset+E-1),
    expert_weights [T, k], and MXFP4-encoded random expert weights (E experts)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * gain * D**-0.5
    w2 = torch.randn(E, D, I, generator=gen) * I**-0.5
    p13, s13 = mxfp4.encode(w13)
    p2, s2 = mxfp4.encode(w2)
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:k] for _ in range(T)])
    ids[0, 0] = offset  # at least one local pair
    return dict(
        x=torch.randn(T, D, generator=gen),
        expert_ids=ids.to(torch.int64),
        expert_weights=torch.rand(T, k, generator=gen),
        w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2,
    ), offset  # fmt: skip


CASES = {
    "decode_few_tokens": dict(T=3, k=4),
    "prefill": dict(T=40, k=2, E=4, num_global=8, offset=2),
    "all_experts_local": dict(T=9, k=3, E=6, num_global=6, offset=0),
    "wide_dims": dict(T=5, k=2, D=96, I=160, E=3, num_global=6, offset=3),
    "one_token_few_of_many": dict(T=1, k=2, E=16, num_global=16, offset=0),  # the ORT body's gathered branch
}


def oracle(case, offset, activation, beta=4.0, linear_beta=25.0):
    """Decode all local experts, run every token through every local expert, mix with a routing matrix."""
    w13 = mxfp4.decode(case["w13_packed"], case["w13_scale"])  # [E, 2I, D]
    w2 = mxfp4.decode(case["w2_packed"], case["w2_scale"])  # [E, D, I]
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    h = torch.einsum("td,efd->etf", case["x"].float(), w13)
    g, u = h[..., :inter], h[..., inter:]
    if activation == "situ":
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)
    else:
        a = g / (1 + torch.exp(-g)) * u
    out = torch.einsum("eti,edi->etd", a, w2)
    slot = (case["expert_ids"] - offset).clamp(-1, num_local) + 1  # 0 and E+1: other ranks
    onehot = torch.nn.functional.one_hot(slot, num_local + 2)[..., 1:-1]
    mix = (onehot * case["expert_weights"][..., None]).sum(1)  # [T, E]
    return torch.einsum("te,etd->td", mix, out)


EXPERTS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def kernel_case(case):
    """make_case's inputs as the Triton kernels take them: bf16 x, the experts in the kernel layout (`layout.py`)."""
    prepared = layout.kernel_experts(*(case[k] for k in EXPERTS))
    return {**case, "x": case["x"].bfloat16(), **dict(zip(EXPERTS, prepared))}


def bf16_reference(case, offset, **kw):
    """The reference on x rounded to bf16 (what the Triton kernels are given)."""
    return reference.moe_mxfp4_reference(**{**case, "x": case["x"].bfloat16().float()}, expert_offset=offset, **kw)


# --------------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_decode_then_matmul(name, activation):
    case, offset = make_case(seed=1, **CASES[name])
    got = reference.moe_mxfp4_reference(**case, expert_offset=offset, activation=activation)
    close(got, oracle(case, offset, activation))
    assert got.abs().max() > 0


def test_situ_clamps_engage():
    """Large pre-activations (gain 40): the tanh caps matter, and the reference still matches the oracle."""
    case, offset = make_case(seed=2, T=4, gain=40.0)
    got = reference.moe_mxfp4_reference(**case, expert_offset=offset, situ_beta=4.0, situ_linear_beta=25.0)
    close(got, oracle(case, offset, "situ"))
    unclamped = reference.moe_mxfp4_reference(**case, expert_offset=offset, situ_beta=1e4, situ_linear_beta=1e4)
    assert (got - unclamped).abs().max() > 1.0


# ------------------------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_matches_reference(name, activation):
    case, offset = make_case(seed=3, **CASES[name])
    want = reference.moe_mxfp4_reference(**case, expert_offset=offset, activation=activation)
    close(cpu.moe_mxfp4_cpu(**case, expert_offset=offset, activation=activation), want)


def test_cpu_small_tiles_repeated_expert_bf16_input(monkeypatch):
    """Row tiles of 2-3 rows, a token choosing the same expert twice, and a bf16 activation input."""
    monkeypatch.setattr(cpu, "_TILE_ELEMS", 600)
    case, offset = make_case(seed=4, T=6, k=3)
    case["expert_ids"][1] = torch.tensor([offset + 1, offset + 1, offset])
    case["x"] = case["x"].bfloat16()
    want = reference.moe_mxfp4_reference(**case, expert_offset=offset)
    close(cpu.moe_mxfp4_cpu(**case, expert_offset=offset), want)


def test_cpu_no_local_experts_gives_zeros_and_rejects_bad_activation():
    case, _ = make_case(seed=5)
    y = cpu.moe_mxfp4_cpu(**case, expert_offset=100)
    assert y.shape == case["x"].shape and y.abs().max() == 0
    with pytest.raises(ValueError):
        cpu.moe_mxfp4_cpu(**case, expert_offset=0, activation="gelu")


# ------------------------------------------------------------------------------ ONNX + ORT path


def onnx_model(case, offset, activation, with_function=True):
    """Model with one MoEMXFP4 node (+ its function)."""
    onnx_schema.register()
    T, D = case["x"].shape
    E, two_i, _ = case["w13_packed"].shape
    I, k = two_i // 2, case["expert_ids"].shape[1]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
        helper.make_tensor_value_info("expert_ids", TensorProto.INT64, ["T", k]),
        helper.make_tensor_value_info("expert_weights", TensorProto.FLOAT, ["T", k]),
        helper.make_tensor_value_info("w13_packed", TensorProto.UINT8, [E, 2 * I, D // 2]),
        helper.make_tensor_value_info("w13_scale", TensorProto.UINT8, [E, 2 * I, D // 32]),
        helper.make_tensor_value_info("w2_packed", TensorProto.UINT8, [E, D, I // 2]),
        helper.make_tensor_value_info("w2_scale", TensorProto.UINT8, [E, D, I // 32]),
    ]
    node = onnx_schema.make_node(*[i.name for i in inputs], "y", expert_offset=offset, activation=activation)
    graph = helper.make_graph([node], "moe", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", D])])
    opsets = [helper.make_opsetid("", ort.ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, functions=[ort.function_proto()] if with_function else [])


@pytest.mark.parametrize("with_function", [False, True])
def test_schema_checker_and_strict_shape_inference(with_function):
    case, offset = make_case()
    model = onnx_model(case, offset, "situ", with_function)
    model.graph.ClearField("output")
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    assert [d.dim_param or d.dim_value for d in inferred.graph.output[0].type.tensor_type.shape.dim] == ["T", 64]
    names = {a.name for a in model.graph.node[0].attribute}
    assert names == {"expert_offset", "activation", "situ_beta", "situ_linear_beta", "plugin_version", "plugin_namespace"}
    with pytest.raises(ValueError):
        onnx_schema.make_node(*"abcdefg", "y", expert_offset=0, activation="gelu")


@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("name", list(CASES))
def test_ort_function_matches_reference(name, activation):
    import onnxruntime

    case, offset = make_case(seed=6, **CASES[name])
    model = onnx_model(case, offset, activation)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in case.items()})[0])
    close(got, reference.moe_mxfp4_reference(**case, expert_offset=offset, activation=activation))


@pytest.mark.parametrize("num_local", [5, 16])
def test_ort_function_multiplies_only_the_chosen_experts(num_local):
    """No local expert chosen: zeros; an unchosen expert with NaN scales leaves y finite and equal to the
    reference, both when the body gathers the 2 chosen experts (16 local) and when it multiplies all of them
    (5 local: 3 x 2 >= 5); a repeated expert in a token's choices counts twice."""
    import onnxruntime

    case, offset = make_case(seed=7, T=4, k=2, E=num_local, num_global=32, offset=4)
    case["expert_ids"][:] = torch.tensor([[offset, offset + 2], [offset + 2, 31], [0, 1], [offset, offset]])
    case["w13_scale"][1] = 255  # expert offset+1: nobody chose it
    sess = onnxruntime.InferenceSession(onnx_model(case, offset, "situ").SerializeToString(),
                                        providers=["CPUExecutionProvider"])  # fmt: skip

    def run(c):
        return torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in c.items()})[0])

    got = run(case)
    assert torch.isfinite(got).all() and got[2].abs().max() == 0
    close(got, reference.moe_mxfp4_reference(**case, expert_offset=offset, activation="situ"))
    off_rank = dict(case, expert_ids=torch.full_like(case["expert_ids"], 31))
    assert run(off_rank).abs().max() == 0


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


# bf16 x in, bf16 out, bf16 activations between the projections, fp32 accumulation, weights decoded exactly into
# bf16 (E2M1 times a power of two): against the reference on the same bf16 x, the error is the roundings of act
# and y (2^-9 relative each) grown by the sums: within 2e-2 of max |y|.
BF16_TOL = 2e-2


@inner_triton
@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("name", list(CASES))
def test_inner_triton_matches_reference(name, activation):
    """bf16 x (the only input the kernels take): within BF16_TOL of the reference on the same x, every edge case."""
    from moe_export.plugins.moe_mxfp4 import triton_kernel

    case, offset = make_case(seed=7, **CASES[name])
    want = bf16_reference(case, offset, activation=activation)
    got = triton_kernel.moe_mxfp4_triton(**kernel_case(case), expert_offset=offset, activation=activation)
    assert got.dtype == torch.bfloat16
    close(got, want, tol=BF16_TOL)
    with pytest.raises(AssertionError):  # the bf16 path is not exact: the tolerance above is needed
        close(got, want)


@inner_triton
def test_inner_triton_refuses_fp32_and_the_standard_layout_differs():
    """fp32 x is refused (callers pass bf16); the standard MXFP4 bytes are not what the kernels read."""
    from moe_export.plugins.moe_mxfp4 import triton_kernel

    case, offset = make_case(seed=9, **CASES["prefill"])
    with pytest.raises(ValueError, match="x must be bf16"):
        triton_kernel.moe_mxfp4_triton(**{**kernel_case(case), "x": case["x"]}, expert_offset=offset)
    standard = triton_kernel.moe_mxfp4_triton(**{**case, "x": case["x"].bfloat16()}, expert_offset=offset)
    with pytest.raises(AssertionError):
        close(standard, bf16_reference(case, offset), tol=BF16_TOL)


@inner_triton
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_inner_triton_split_k(activation):
    """K split over programs (the decode grids of few experts): the up projection's partial sums [split, C, 2I]
    summed by the activation kernel, the down projection's partial rows summed by the combine, over 2 and 3 splits
    of one K step each (D 64, I 96 at BLOCK_K 32), repeated and off-rank experts: within BF16_TOL of the reference."""
    from moe_export.plugins.moe_mxfp4 import triton_kernel

    case, offset = make_case(seed=9, T=5, k=3)
    case["expert_ids"][1] = torch.tensor([offset + 1, offset + 1, offset])
    case["expert_ids"][2] = torch.tensor([0, 1, 2])  # nothing on this rank
    want = bf16_reference(case, offset, activation=activation)
    tiles = dict(block_m=4, block_n=16, block_k=32, split_up=2, split_down=3)
    got = triton_kernel.moe_mxfp4_triton(**kernel_case(case), expert_offset=offset, activation=activation,
                                         tiles=tiles)  # fmt: skip
    close(got, want, tol=BF16_TOL)
    assert got[2].abs().max() == 0


@inner_triton
def test_inner_triton_prefill_tiles_of_128_rows():
    """The prefill tiles at 256 pairs or more per expert (`sizes.block_m_for`): blocks of 128 pair rows (tokens x
    weights, the wgmma orientation), 64 weight rows: within BF16_TOL of the reference."""
    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel

    case, offset = make_case(seed=10, T=40, k=3, E=2, offset=0, num_global=3)  # 80 of 120 pairs on this rank
    want = bf16_reference(case, offset)
    assert sizes.block_m_for(256 * 2, 2) == 128
    tiles = dict(block_m=128, block_n=64, block_k=32, num_warps=8)
    close(triton_kernel.moe_mxfp4_triton(**kernel_case(case), expert_offset=offset, tiles=tiles), want, tol=BF16_TOL)


@inner_triton
def test_inner_triton_block_layout_repeated_expert_and_off_rank():
    """Pairs grouped by expert in one layout launch and padded to BLOCK_M; duplicates, off-rank ids, chunks and
    a caller's workspace; the layout equals grouping the pairs on the host, sized from shapes only."""
    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel

    case, offset = make_case(seed=8, T=6, k=3)
    case["expert_ids"][1] = torch.tensor([offset + 1, offset + 1, offset])
    case["expert_ids"][2] = torch.tensor([0, 1, 2])  # nothing on this rank
    want = bf16_reference(case, offset)
    case = kernel_case(case)
    tiles = dict(block_m=4, block_n=16, block_k=32)
    got = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles)
    close(got, want, tol=BF16_TOL)
    assert got[2].abs().max() == 0
    gen = torch.Generator().manual_seed(3)
    for trial in range(3):
        ids = torch.randint(0, 12, (9, 3), generator=gen)
        if trial == 0:
            ids[:] = 5  # every pair on one expert
        rows, experts, num_blocks = triton_kernel.pair_layout(ids, 4, 5, 4)
        assert rows.numel() == sizes.pair_capacity(27, 5, 4) == 4 * experts.numel()
        local = ids.view(-1) - 4
        grouped = {e: [p for p in range(27) if local[p] == e] for e in range(5)}
        assert int(num_blocks) == sum(-(-len(v) // 4) for v in grouped.values())  # the used blocks, counted
        got_groups: dict[int, list[int]] = {}
        for b, e in enumerate(experts[: int(num_blocks)].tolist()):  # the blocks past them are never read
            block = rows[4 * b : 4 * b + 4].tolist()
            real = [r for r in block if r >= 0]
            assert block == real + [-1] * (4 - len(real)) and real  # pairs first, then padding
            got_groups.setdefault(e, []).extend(real)
        assert got_groups == {e: v for e, v in grouped.items() if v}
    # chunked over tokens (scratch bounded by the budget): the same result
    close(triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1), want, tol=BF16_TOL)
    # in a caller's workspace (TensorRT: the plugin's second output), poisoned first: the same result
    size = sizes.workspace_bytes(6, 3, 64, 96, 5, block_m=4, budget_bytes=1)
    workspace = torch.full((size,), 0xFF, dtype=torch.uint8)
    got = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1,
                                         workspace=workspace)  # fmt: skip
    close(got, want, tol=BF16_TOL)
    with pytest.raises(ValueError, match="workspace"):
        triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1,
                                       workspace=workspace[:16])  # fmt: skip


def counted_case(seed, n, rows, garbage, dtype, E=5, k=3, offset=4):
    """`rows` receive-buffer rows whose first n are valid (make_case's, each with its first two choices on this
    rank, so experts span several blocks) and the rest garbage: x and weights NaN ("nan") or large finite values
    ("finite"), ids of every kind (-1, negative, off rank, this rank's, this rank's plus 2^40). -> (case, offset,
    recv_counts [3] summing to n, the reference over the n valid rows)."""
    case, offset = make_case(seed=seed, T=max(n, 1), k=k, E=E, offset=offset)
    case["expert_ids"][:, 0], case["expert_ids"][:, 1] = offset, offset + 1
    valid = {name: t[:n] for name, t in case.items() if name in ("x", "expert_ids", "expert_weights")}
    gen = torch.Generator().manual_seed(seed + 100)
    junk_ids = torch.randint(-3, 16, (rows - n, k), generator=gen)
    junk_ids[::2, 0] = 2**40 + offset  # this rank's expert in the low 32 bits
    junk_ids[1::3, 1] = -(2**40)
    fill = float("nan") if garbage == "nan" else 1e4
    junk = dict(x=torch.randn(rows - n, case["x"].shape[1], generator=gen) * fill,
                expert_ids=junk_ids, expert_weights=torch.rand(rows - n, k, generator=gen) * fill)  # fmt: skip
    want = reference.moe_mxfp4_reference(**{**case, **valid, "x": valid["x"].to(dtype)}, expert_offset=offset)
    case.update({name: torch.cat([valid[name], junk[name]]) for name in valid})
    case = kernel_case(case)
    case["x"] = case["x"].to(dtype)
    return case, offset, torch.tensor([n // 2, 0, n - n // 2]), want


COUNTED = {  # dtype, garbage, rows per chunk (None: one chunk), BLOCK_M 4 tiles, one SM (combine programs loop)
    "bf16_nan_one_chunk_looping_programs": (torch.bfloat16, "nan", None, True, True),
    "bf16_finite_chunks_small_tiles": (torch.bfloat16, "finite", 2, True, False),
    "bf16_nan_chunks": (torch.bfloat16, "nan", 2, False, True),
    "bf16_finite_one_chunk": (torch.bfloat16, "finite", None, False, False),
}


@inner_triton
@pytest.mark.parametrize("name", list(COUNTED))
def test_inner_triton_counted_rows(name, monkeypatch):
    """recv_counts: rows [0, n) equal the reference over those rows (within BF16_TOL), garbage past n never read, y past n never written (NaN sentinel),
    row_bound below the buffer's rows, in one chunk or in chunks (one half valid, one past n)."""
    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel

    dtype, garbage, chunk, small_tiles, one_sm = COUNTED[name]
    if one_sm:
        monkeypatch.setattr(sizes, "H200_SMS", 1)
    n, rows, bound = 9, 16, 11
    case, offset, counts, want = counted_case(3, n, rows, garbage, dtype)
    tiles = dict(block_m=4, block_n=16, block_k=32) if small_tiles else None
    budget = 4 * 3 * (64 + 96) * chunk if chunk else sizes.DEFAULT_SCRATCH_BUDGET
    out = torch.full((rows, 64), float("nan"), dtype=dtype)
    got = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=budget, out=out,
                                         recv_counts=counts, row_bound=bound)  # fmt: skip
    assert got is out and got.dtype == dtype
    close(got[:n], want, tol=BF16_TOL)
    assert got[n:].isnan().all()
    if small_tiles and not chunk:  # the up and down programs loop over more used blocks than there are programs
        _, _, used = triton_kernel.pair_layout(case["expert_ids"][:bound], offset, 5, 4, recv_counts=counts)
        assert int(used) > sizes.block_programs(bound * 3, 5, 4, counted=True)
    if one_sm:
        assert sizes.combine_programs(bound, 64, counted=True) < n


@inner_triton
def test_inner_triton_counted_all_rows_and_none():
    """n = every row (int32 counts): the same bits as without recv_counts (in a poisoned caller's workspace); n = 0:
    nothing written; row_bound without recv_counts, or past the buffer: clear errors."""
    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel

    case, offset = make_case(seed=11, T=9, k=3)
    case = kernel_case(case)
    full = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset)
    workspace = torch.full((sizes.workspace_bytes(9, 3, 64, 96, 5),), 0xFF, dtype=torch.uint8)
    counted = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, recv_counts=torch.tensor([4, 5]).int(),
                                             workspace=workspace)  # fmt: skip
    assert torch.equal(counted, full) and full.abs().max() > 0
    out = torch.full((9, 64), float("nan"), dtype=torch.bfloat16)
    triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, out=out, recv_counts=torch.zeros(2, dtype=torch.int64),
                                   row_bound=4)  # fmt: skip
    assert out.isnan().all()
    with pytest.raises(ValueError, match="row_bound"):
        triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, row_bound=4)
    with pytest.raises(ValueError, match="row_bound 10 outside"):
        triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, recv_counts=torch.tensor([1]), row_bound=10)
    with pytest.raises(ValueError, match="recv_counts"):
        triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, recv_counts=torch.tensor([1.0]))


def test_kernels_compile_for_sm90_static_and_counted():
    """The kernels compile to sm_90 PTX with no GPU (the interpreter does not run Triton's code generation):
    static and counted modes (counts pointer absent or given), the decode and the K3 row-bound tiles, bf16 dots on
    the tensor cores (wgmma at BLOCK_M 64 and 128)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel as tk

    pointers = dict(x_ptr="*bf16", act_ptr="*bf16", y_ptr="*bf16", partial_ptr="*fp32", out_ptr="*fp32",
                    route_w_ptr="*fp32", w_ptr="*u8", s_ptr="*u8", pre_ptr="*fp32", pair_rows_ptr="*i64", pair_ptr="*i64",
                    ids_ptr="*i64", counts_ptr="*i64", block_expert_ptr="*i32", num_blocks_ptr="*i32")  # fmt: skip

    def ptx(kernel, constexprs, **options):
        signature = {a: pointers.get(a, "fp32" if "beta" in a else "i32") for a in kernel.arg_names}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        code = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        assert f".entry {kernel.__name__}(" in code and ".target sm_90" in code
        return code

    for counted in (False, True):
        absent = {} if counted else {"counts_ptr": None}
        ptx(tk._pair_layout_kernel, dict(COUNTED=counted, BLOCK_M=16, BLOCK_P=256, BLOCK_E=16, BLOCK_S=64, **absent))
        ptx(tk._combine_kernel, dict(COUNTED=counted, BLOCK_D=512, BLOCK_S=64, **absent))
    for pairs in (16, 192 * 16, 4096 * 4):  # one token; K3's decode row bound; a 4,096-token prefill
        cfg = sizes.tile_config(pairs, 14, 3584, 3072)
        tiles = dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], EVEN=True,
                     SPLIT=cfg["split_up"] > 1, WEIGHTS_LEFT=cfg["block_m"] < 64, UPCAST=False)  # fmt: skip
        launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        up = ptx(tk._moe_up_kernel, dict(ACT_SILU=False, **tiles), **launch)
        down = ptx(tk._moe_down_kernel, {**tiles, "SPLIT": cfg["split_down"] > 1}, **launch)
        if cfg["block_m"] >= 64:
            assert "wgmma.mma_async" in up and "wgmma.mma_async" in down


def test_tile_config_fills_the_gpu_at_decode():
    """Decode shapes (one EP rank of K3: 14 experts, D 3584, I 3072) take tiles of 64 weight rows and split K
    until every SM of an H200 has a program (one token, one expert: 48 and 56 N tiles, split 3 ways); prefill
    takes wgmma tiles of 64 tokens (the dp row bound) or 128 (a 4,096-token step)."""
    from moe_export.plugins.moe_mxfp4 import sizes

    for pairs in (1, 2, 16, 64 * 4):
        cfg = sizes.tile_config(pairs, 14, 3584, 3072)
        blocks = min(14, pairs)
        assert cfg["block_m"] == 16 and cfg["block_n"] == 64
        assert blocks * 3072 // 64 * cfg["split_up"] >= sizes.H200_SMS  # every SM reads weights
        assert blocks * 3584 // 64 * cfg["split_down"] >= sizes.H200_SMS
    one = sizes.tile_config(1, 14, 3584, 3072)
    assert (one["split_up"], one["split_down"]) == (3, 3)
    assert sizes.split_k(1000, 3584, 256) == 1 and sizes.split_k(1, 512, 256) == 2  # at most one split per step
    assert sizes.tile_config(192 * 16, 14, 3584, 3072)["block_m"] == 64  # the dp layer's K3 row bound
    assert sizes.tile_config(4096 * 4, 14, 3584, 3072)["block_m"] == 128  # prefill: a decoded tile, 128 tokens


def test_scratch_bytes_bounded_by_the_budget():
    from moe_export.plugins.moe_mxfp4 import sizes

    k3 = dict(top_k=16, dim=3584, inter=2048, num_local=14)  # K3 latent MoE on an ep=64 rank
    budget = sizes.DEFAULT_SCRATCH_BUDGET
    big = sizes.workspace_bytes(16384, **k3, budget_bytes=budget)
    assert big == sizes.workspace_bytes(1 << 20, **k3, budget_bytes=budget) < 1.2 * budget
    assert sizes.workspace_bytes(1, **k3, budget_bytes=budget) < big
    assert 16384 * 16 * 3584 * 4 > 12 * budget  # the unchunked [T*k, D] fp32 buffer of before


def test_kernel_layout_round_trips_and_bounds_the_scales():
    """The kernel layout is a permutation of the bits of each 32-bit word (every byte value, inverse exact);
    scale bytes above 128 (block scales above 2) are refused, naming the tensor."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(3).view(3, 2, 128)
    moved = layout.to_kernel_layout(packed)
    assert moved.shape == packed.shape and moved.dtype == torch.uint8 and not torch.equal(moved, packed)
    assert torch.equal(layout.from_kernel_layout(moved), packed)
    scales = torch.full((3, 2, 8), 128, dtype=torch.uint8)
    layout.kernel_experts(packed, scales, packed, scales)
    scales[1, 0, 5] = 129
    with pytest.raises(ValueError, match=r"w2_scale: E8M0 scale byte 129 at \[1, 0, 5\]"):
        layout.kernel_experts(packed, scales.clamp(max=128), packed, scales)

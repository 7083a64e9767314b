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
from moe_export.plugins.moe_mxfp4 import cpu, onnx_schema, ort, reference
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


@inner_triton
@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("name", list(CASES))
def test_inner_triton_matches_reference(name, activation):
    """fp32 x: exact fp32 dots, within 1e-5 of the reference (relative to max(1, max |y|))."""
    from moe_export.plugins.moe_mxfp4 import triton_kernel

    case, offset = make_case(seed=7, **CASES[name])
    want = reference.moe_mxfp4_reference(**case, expert_offset=offset, activation=activation)
    close(triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, activation=activation), want)


@inner_triton
@pytest.mark.parametrize("name", ["decode_few_tokens", "prefill"])
def test_inner_triton_bf16_in_and_out(name):
    """bf16 x (the tensor-core path: bf16 operands, fp32 accumulation, bf16 activations and output): within 2e-2
    of the fp32 reference relative to max |y| (three bf16 roundings of 2^-9 each, x, act and y, grown by the
    sums); the weights decode exactly into bf16 (E2M1 times a power of two)."""
    from moe_export.plugins.moe_mxfp4 import triton_kernel

    case, offset = make_case(seed=9, **CASES[name])
    want = reference.moe_mxfp4_reference(**case, expert_offset=offset, activation="silu")
    got = triton_kernel.moe_mxfp4_triton(**{**case, "x": case["x"].bfloat16()}, expert_offset=offset,
                                         activation="silu")  # fmt: skip
    assert got.dtype == torch.bfloat16
    close(got, want, tol=2e-2)
    with pytest.raises(AssertionError):  # the bf16 path is not exact: the tolerance above is needed
        close(got, want)


@inner_triton
def test_inner_triton_block_layout_repeated_expert_and_off_rank():
    """Pairs grouped by expert in one layout launch and padded to BLOCK_M; duplicates, off-rank ids, chunks and
    a caller's workspace; the layout equals grouping the pairs on the host, sized from shapes only."""
    from moe_export.plugins.moe_mxfp4 import sizes, triton_kernel

    case, offset = make_case(seed=8, T=6, k=3)
    case["expert_ids"][1] = torch.tensor([offset + 1, offset + 1, offset])
    case["expert_ids"][2] = torch.tensor([0, 1, 2])  # nothing on this rank
    want = reference.moe_mxfp4_reference(**case, expert_offset=offset)
    tiles = dict(block_m=4, block_n=16, block_k=32)
    got = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles)
    close(got, want)
    assert got[2].abs().max() == 0
    gen = torch.Generator().manual_seed(3)
    for trial in range(3):
        ids = torch.randint(0, 12, (9, 3), generator=gen)
        if trial == 0:
            ids[:] = 5  # every pair on one expert
        rows, experts = triton_kernel.pair_layout(ids, 4, 5, 4)
        assert rows.numel() == sizes.pair_capacity(27, 5, 4) == 4 * experts.numel()
        local = ids.view(-1) - 4
        grouped = {e: [p for p in range(27) if local[p] == e] for e in range(5)}
        got_groups: dict[int, list[int]] = {}
        for b, e in enumerate(experts.tolist()):
            block = rows[4 * b : 4 * b + 4].tolist()
            if e < 0:  # past the used blocks: empty, the kernels return at once
                assert block == [-1] * 4
                continue
            real = [r for r in block if r >= 0]
            assert block == real + [-1] * (4 - len(real)) and real  # pairs first, then padding
            got_groups.setdefault(e, []).extend(real)
        assert got_groups == {e: v for e, v in grouped.items() if v}
    # chunked over tokens (scratch bounded by the budget): the same result
    close(triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1), want)
    # in a caller's workspace (TensorRT: the plugin's second output), poisoned first: the same result
    size = sizes.workspace_bytes(6, 3, 64, 96, 5, block_m=4, budget_bytes=1)
    workspace = torch.full((size,), 0xFF, dtype=torch.uint8)
    got = triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1,
                                         workspace=workspace)  # fmt: skip
    close(got, want)
    with pytest.raises(ValueError, match="workspace"):
        triton_kernel.moe_mxfp4_triton(**case, expert_offset=offset, tiles=tiles, budget_bytes=1,
                                       workspace=workspace[:16])  # fmt: skip


def test_tile_config_fills_the_gpu_at_decode():
    """Decode shapes (one EP rank of K3: 14 experts, D 3584, I 3072) shrink BLOCK_N towards two programs per SM of
    an H200 (one token, one expert: 16, so every SM gets one); prefill takes the 64 x 128 tensor-core tiles."""
    from moe_export.plugins.moe_mxfp4 import sizes

    one = sizes.tile_config(1, 14, 3584, 3072)
    assert one["block_m"] == 16 and one["block_n"] == 16 and 3072 // 16 >= sizes.H200_SMS  # every SM reads
    assert sizes.tile_config(256, 14, 3584, 3072)["block_n"] == 128
    assert sizes.tile_config(4096 * 4, 14, 3584, 3072)["block_m"] == 64


def test_scratch_bytes_bounded_by_the_budget():
    from moe_export.plugins.moe_mxfp4 import sizes

    k3 = dict(top_k=16, dim=3584, inter=2048, num_local=14)  # K3 latent MoE on an ep=64 rank
    budget = sizes.DEFAULT_SCRATCH_BUDGET
    big = sizes.workspace_bytes(16384, **k3, budget_bytes=budget)
    assert big == sizes.workspace_bytes(1 << 20, **k3, budget_bytes=budget) < 1.2 * budget
    assert sizes.workspace_bytes(1, **k3, budget_bytes=budget) < big
    assert 16384 * 16 * 3584 * 4 > 12 * budget  # the unchunked [T*k, D] fp32 buffer of before

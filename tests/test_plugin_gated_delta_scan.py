"""gated_delta_scan: reference vs external oracles (fla naive, transformers' torch KDA), and the CPU,
Triton (interpreter, in a subprocess) and ONNX Runtime implementations vs the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.plugins.gated_delta_scan import cpu, onnx_schema, ort, reference
from conftest import load_fla_naive, run_triton_inner_tests
from fp32_reorder import scan_rtol

REPO = Path(__file__).resolve().parents[1]


def make_inputs(B, T, H, K, V, g_low=-5.0, seed=0, dtype=torch.float32):
    """Random q, k, v, g in (g_low, 0), beta in (0, 1); all [B, T, H, *]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.rand(B, T, H, K, generator=gen) * g_low
    beta = torch.rand(B, T, H, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def close(a, b, rtol):
    """Max abs error relative to the reference's max magnitude below `rtol` (a scan_rtol)."""
    err = float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)
    assert err < rtol, err


@pytest.fixture(scope="module")
def fla_naive():
    return load_fla_naive("ops/kda/naive.py")


# --------------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("l2", [False, True])
def test_reference_matches_fla_naive(fla_naive, l2):
    q, k, v, g, beta = make_inputs(2, 37, 3, 16, 8)
    h0 = torch.randn(2, 3, 16, 8)
    o, s = reference.gated_delta_scan(
        q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    if l2:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    close(o, o_ref, scan_rtol(37, 16, 8))
    close(s, s_ref, scan_rtol(37, 16, 8))


def test_reference_varlen_matches_fla_naive_per_sequence(fla_naive):
    cu = torch.tensor([0, 5, 5, 23, 24])
    q, k, v, g, beta = make_inputs(1, 24, 2, 8, 8, seed=1)
    h0 = torch.randn(4, 2, 8, 8)
    o, s = reference.gated_delta_scan(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(4):
        a, b = int(cu[n]), int(cu[n + 1])
        seq = (x[:, a:b] for x in (q, k, v, g, beta))
        o_n, s_n = fla_naive.naive_recurrent_kda(*seq, initial_state=h0[n : n + 1], output_final_state=True)
        if b > a:
            close(o[:, a:b], o_n, scan_rtol(24, 8, 8))
        close(s[n : n + 1], s_n, scan_rtol(24, 8, 8))


TRANSFORMERS_SCRIPT = r"""
import sys, torch
sys.modules["fla"] = None  # make transformers pick its torch fallbacks instead of fla's Triton kernels
from transformers.models.kimi_linear import modeling_kimi_linear as m
x = torch.load(sys.argv[1])
out = {}
for name in ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention"):
    fn = getattr(m, name)
    o, s = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"], output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    out[name] = (o, s)
torch.save(out, sys.argv[2])
"""


def test_reference_matches_transformers_torch_kda(tmp_path):
    """transformers' torch KDA (recurrent and chunked, T not a multiple of 64), run in a subprocess."""
    import transformers  # noqa: F401  (test extra: a missing oracle is a broken install, not a skip)
    q, k, v, g, beta = make_inputs(2, 70, 2, 16, 16, seed=2)
    h0 = torch.randn(2, 2, 16, 16)
    torch.save(dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0), tmp_path / "in.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    out = torch.load(tmp_path / "out.pt")
    o, s = reference.gated_delta_scan(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for o_ref, s_ref in out.values():
        close(o, o_ref, scan_rtol(70, 16, 16))
        close(s, s_ref, scan_rtol(70, 16, 16))


# ------------------------------------------------------------------------------ cpu vs reference

CASES = {
    # name: (B, T, H, K, V, cu_seqlens, g_low)
    "batched_T70": (2, 70, 2, 16, 8, None, -5.0),
    "varlen_empty_and_multichunk": (1, 150, 2, 16, 16, [0, 5, 5, 100, 150, 150], -5.0),
    "varlen_leading_empty": (1, 40, 2, 8, 8, [0, 0, 40], -1.0),
    "decode": (3, 1, 2, 16, 8, None, -5.0),
    "decode_varlen": (1, 3, 2, 16, 8, [0, 1, 2, 3], -5.0),
    "strong_gate": (1, 130, 2, 16, 8, [0, 1, 130], -20.0),
    "weak_gate": (1, 96, 2, 16, 8, None, -0.05),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("l2", [False, True])
def test_cpu_matches_reference(name, l2):
    B, T, H, K, V, cu, g_low = CASES[name]
    q, k, v, g, beta = make_inputs(B, T, H, K, V, g_low=g_low, seed=3)
    cu_t = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V)
    kw = dict(scale=0.2, initial_state=h0, output_final_state=True, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=l2)
    o_ref, s_ref = reference.gated_delta_scan(q, k, v, g, beta, **kw)
    o, s = cpu.gated_delta_scan(q, k, v, g, beta, **kw)
    close(o, o_ref, scan_rtol(T, K, V))
    close(s, s_ref, scan_rtol(T, K, V))


@pytest.mark.parametrize("max_mid_exponent", [0.0, float("inf")])
def test_cpu_both_diagonal_block_paths(monkeypatch, max_mid_exponent):
    """Force the pairwise (0) and the factored (inf) diagonal-block computation."""
    monkeypatch.setattr(cpu, "_MAX_MID_EXPONENT", max_mid_exponent)
    q, k, v, g, beta = make_inputs(1, 100, 2, 16, 8, g_low=-5.0, seed=4)
    o_ref, s_ref = reference.gated_delta_scan(q, k, v, g, beta, output_final_state=True)
    o, s = cpu.gated_delta_scan(q, k, v, g, beta, output_final_state=True)
    close(o, o_ref, scan_rtol(100, 16, 8))
    close(s, s_ref, scan_rtol(100, 16, 8))


def test_cpu_default_scale_no_state_and_bf16():
    q, k, v, g, beta = make_inputs(1, 20, 2, 16, 8, seed=5, dtype=torch.bfloat16)
    o_ref, s_ref = reference.gated_delta_scan(q, k, v, g, beta)
    o, s = cpu.gated_delta_scan(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16 and s is None and s_ref is None
    close(o, o_ref, scan_rtol(20, 16, 8, torch.bfloat16))


def test_cpu_safe_gate_long_sequence():
    """K3 safe gate g in (-5, 0) over several chunks, with l2-normalised q/k as the model uses them."""
    q, k, v, g, beta = make_inputs(1, 300, 2, 32, 32, g_low=-5.0, seed=6)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = reference.gated_delta_scan(q, k, v, g, beta, **kw)
    o, s = cpu.gated_delta_scan(q, k, v, g, beta, **kw)
    close(o, o_ref, scan_rtol(300, 32, 32))
    close(s, s_ref, scan_rtol(300, 32, 32))


@pytest.mark.parametrize("impl", [reference, cpu])
def test_state_carried_across_calls(impl):
    """Prefill at once == prefill in two calls == prefill then token-by-token decode (varlen, 2 sequences)."""
    q, k, v, g, beta = make_inputs(2, 80, 2, 16, 8, seed=7)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_all, s_all = impl.gated_delta_scan(q, k, v, g, beta, **kw)
    o1, s1 = impl.gated_delta_scan(*(x[:, :67] for x in (q, k, v, g, beta)), **kw)
    o2, s2 = impl.gated_delta_scan(*(x[:, 67:] for x in (q, k, v, g, beta)), initial_state=s1, **kw)
    close(torch.cat([o1, o2], 1), o_all, scan_rtol(80, 16, 8))
    close(s2, s_all, scan_rtol(80, 16, 8))
    s, outs = s1, [o1]
    for t in range(67, 80):
        o_t, s = impl.gated_delta_scan(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=s, **kw)
        outs.append(o_t)
    close(torch.cat(outs, 1), o_all, scan_rtol(80, 16, 8))
    close(s, s_all, scan_rtol(80, 16, 8))


def test_rejects_bad_shapes():
    q, k, v, g, beta = make_inputs(2, 4, 2, 8, 8)
    with pytest.raises(ValueError):
        cpu.gated_delta_scan(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError):
        cpu.gated_delta_scan(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError):
        cpu.gated_delta_scan(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 8))


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


@inner_triton
@pytest.mark.parametrize("name", ["batched_T70", "varlen_empty_and_multichunk", "decode_varlen", "strong_gate"])
@pytest.mark.parametrize("l2", [False, True])
def test_inner_triton_matches_reference(name, l2):
    from moe_export.plugins.gated_delta_scan import triton_kernel

    B, T, H, K, V, cu, g_low = CASES[name]
    T = min(T, 40) if cu is None else T
    q, k, v, g, beta = make_inputs(B, T, H, K, V, g_low=g_low, seed=8)
    cu_t = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    kw = dict(scale=0.2, initial_state=torch.randn(N, H, K, V), output_final_state=True, cu_seqlens=cu_t,
              use_qk_l2norm_in_kernel=l2)  # fmt: skip
    o_ref, s_ref = reference.gated_delta_scan(q, k, v, g, beta, **kw)
    o, s = triton_kernel.gated_delta_scan(q, k, v, g, beta, **kw)
    close(o, o_ref, scan_rtol(T, K, V))
    close(s, s_ref, scan_rtol(T, K, V))


@inner_triton
def test_inner_triton_value_tiles_and_state_carry():
    """V = 40 spans two value tiles (BV = 32, masked tail); prefill split in two calls == at once."""
    from moe_export.plugins.gated_delta_scan import triton_kernel

    q, k, v, g, beta = make_inputs(1, 12, 2, 8, 40, seed=9)
    o_all, s_all = reference.gated_delta_scan(q, k, v, g, beta, output_final_state=True)
    o1, s1 = triton_kernel.gated_delta_scan(*(x[:, :5] for x in (q, k, v, g, beta)), output_final_state=True)
    o2, s2 = triton_kernel.gated_delta_scan(
        *(x[:, 5:] for x in (q, k, v, g, beta)), initial_state=s1, output_final_state=True
    )
    close(torch.cat([o1, o2], 1), o_all, scan_rtol(12, 8, 40))
    close(s2, s_all, scan_rtol(12, 8, 40))


@inner_triton
def test_inner_triton_pool_matches_node_reference():
    """The kernel reaches the state pool only through the pool table (here row 1 of two)
    and advances its slots in place; the other pool is untouched, and a garbage row touches no pool."""
    from moe_export.plugins.gated_delta_scan import triton_kernel
    from moe_export.plugins.pool_table import device_pool_table

    args = node_inputs(seed=10)
    o_ref, pool_ref = reference.gated_delta_scan_node(*args, scale=0.25, use_qk_l2norm=True)
    pool, other = args[5].clone(), torch.randn_like(args[5])
    other_before = other.clone()
    q, k, v, g, beta = (x.contiguous() for x in (args[0], args[1], args[2], args[3].float(), args[4].float()))
    o = torch.empty_like(v)
    triton_kernel.launch(q, k, v, g, beta, device_pool_table([other, pool]), 1, *args[6:], o, 0.25, True, True)
    close(o, o_ref, scan_rtol(74, 8, 8))
    close(pool, pool_ref, scan_rtol(74, 8, 8))
    assert torch.equal(other, other_before)
    fresh = args[5].clone()
    close(triton_kernel.gated_delta_scan_pool(*args[:5], fresh, *args[6:], scale=0.25, use_qk_l2norm=True), o_ref, scan_rtol(74, 8, 8))
    close(fresh, pool_ref, scan_rtol(74, 8, 8))
    before = fresh.clone()
    triton_kernel.launch(q, k, v, g, beta, torch.tensor([[fresh.data_ptr(), fresh.shape[0], 1]]), 0, *args[6:], o,
                         0.25, True, True)  # fmt: skip
    assert torch.equal(fresh, before)


# --------------------------------------------------------------------------------- node helpers


def node_inputs(seed=0, lengths=(3, 0, 70, 1), S=6, slots=(4, 0, 2, 5), H=2, K=8, V=8):
    """Packed node inputs: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; pool [S, H, V, K]; cu; slot_ids."""
    T = sum(lengths)
    q, k, v, g, beta = (x[0] for x in make_inputs(1, T, H, K, V, seed=seed))
    pool = torch.randn(S, H, V, K, generator=torch.Generator().manual_seed(seed + 1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return q, k, v, g, beta, pool, cu, torch.tensor(slots, dtype=torch.int64)


# ------------------------------------------------------------------------- ONNX schema and ORT


def onnx_model(act=onnx.TensorProto.FLOAT, with_function=True, scale=0.25, use_qk_l2norm=True):
    """Model with one GatedDeltaScan node over graph inputs of the same names (+ its function)."""
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    vi = helper.make_tensor_value_info
    inputs = [
        vi("q", act, ["T", "H", "K"]), vi("k", act, ["T", "H", "K"]), vi("v", act, ["T", "H", "V"]),
        vi("g", f32, ["T", "H", "K"]), vi("beta", f32, ["T", "H"]), vi("state_pool", f32, ["S", "H", "V", "K"]),
        vi("cu_seqlens", i64, ["N1"]), vi("slot_ids", i64, ["N"]),
    ]  # fmt: skip
    outputs = [vi("o", act, ["T", "H", "V"]), vi("state_pool_out", f32, ["S", "H", "V", "K"])]
    node = onnx_schema.make_node(
        *onnx_schema.INPUTS, *onnx_schema.OUTPUTS, scale=scale, use_qk_l2norm=use_qk_l2norm, name="scan0"
    )
    graph = helper.make_graph([node], "gds", inputs, outputs)
    opsets = [helper.make_opsetid("", ort.ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, functions=[ort.function_proto()] if with_function else [])


@pytest.mark.parametrize("with_function", [False, True])
def test_schema_checker_and_strict_shape_inference(with_function):
    onnx_schema.register()
    onnx_schema.register()  # idempotent
    model = onnx_model(with_function=with_function)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert len(inferred.graph.output) == 2


def test_schema_inference_gives_output_types():
    onnx_schema.register()
    model = onnx_model(act=onnx.TensorProto.FLOAT16, with_function=False)
    del model.graph.output[:]
    model.graph.output.extend([onnx.ValueInfoProto(name="o"), onnx.ValueInfoProto(name="state_pool_out")])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    assert types["o"].elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_param for d in types["o"].shape.dim] == ["T", "H", "V"]
    assert types["state_pool_out"].elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param for d in types["state_pool_out"].shape.dim] == ["S", "H", "V", "K"]


def test_make_node_attributes():
    node = onnx_schema.make_node(*onnx_schema.INPUTS, *onnx_schema.OUTPUTS, scale=0.5, use_qk_l2norm=True)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == DOMAIN and node.op_type == "GatedDeltaScan"
    assert attrs == {"scale": 0.5, "use_qk_l2norm": 1, "plugin_version": b"1", "plugin_namespace": b"moe_export"}


ORT_CASES = {
    # name: node_inputs kwargs
    "varlen_empty_slots": dict(lengths=(3, 0, 70, 1), slots=(4, 0, 2, 5)),
    "leading_empty": dict(lengths=(0, 9), slots=(3, 1)),
    "decode": dict(lengths=(1, 1, 1), slots=(5, 2, 0)),
}


def run_ort(model, args):
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {name: a.numpy() for name, a in zip(onnx_schema.INPUTS, args)})


@pytest.mark.parametrize("name", list(ORT_CASES))
@pytest.mark.parametrize("l2", [False, True])
def test_ort_function_matches_reference(name, l2):
    args = node_inputs(seed=11, **ORT_CASES[name])
    o, pool = run_ort(onnx_model(use_qk_l2norm=l2), args)
    o_ref, pool_ref = reference.gated_delta_scan_node(*args, scale=0.25, use_qk_l2norm=l2)
    close(torch.from_numpy(o), o_ref, scan_rtol(len(args[0]), 8, 8))
    close(torch.from_numpy(pool), pool_ref, scan_rtol(len(args[0]), 8, 8))
    untouched = [s for s in range(pool.shape[0]) if s not in ORT_CASES[name]["slots"]]
    assert (torch.from_numpy(pool[untouched]) == args[5][untouched]).all()


def test_ort_function_fp16_activations():
    args = list(node_inputs(seed=12))
    for i in (0, 1, 2):
        args[i] = args[i].half()
    o, pool = run_ort(onnx_model(act=onnx.TensorProto.FLOAT16), args)
    o_ref, pool_ref = reference.gated_delta_scan_node(*args, scale=0.25, use_qk_l2norm=True)
    assert o.dtype == np.float16
    close(torch.from_numpy(o), o_ref, scan_rtol(74, 8, 8, torch.float16))
    close(torch.from_numpy(pool), pool_ref, scan_rtol(74, 8, 8))


def test_ort_prefill_then_decode_through_pool():
    """Prefill (two sequences) then two decode steps feeding state_pool_out back == one long reference scan."""
    H, K, V, S, slots = 2, 8, 8, 4, (3, 1)
    model = onnx_model()
    q, k, v, g, beta = (x[0] for x in make_inputs(1, 2 * 12, H, K, V, seed=13))
    pool0 = torch.randn(S, H, V, K)
    cu_full = torch.tensor([0, 12, 24])
    o_full, pool_full = reference.gated_delta_scan_node(
        q, k, v, g, beta, pool0, cu_full, torch.tensor(slots), scale=0.25, use_qk_l2norm=True
    )
    pre = [torch.cat([x[:10], x[12:22]]) for x in (q, k, v, g, beta)]
    o_pre, pool = run_ort(model, [*pre, pool0, torch.tensor([0, 10, 20]), torch.tensor(slots)])
    outs = [o_pre[:10], o_pre[10:]]
    for t in (10, 11):
        step = [torch.stack([x[t], x[12 + t]]) for x in (q, k, v, g, beta)]
        o_t, pool = run_ort(model, [*step, torch.from_numpy(pool), torch.tensor([0, 1, 2]), torch.tensor(slots)])
        outs[0], outs[1] = np.concatenate([outs[0], o_t[:1]]), np.concatenate([outs[1], o_t[1:]])
    close(torch.from_numpy(np.concatenate(outs)), o_full, scan_rtol(24, K, V))
    close(torch.from_numpy(pool), pool_full, scan_rtol(24, K, V))


def _fla_fused_recurrent():
    """fla's real `fused_recurrent_kda_fwd` (a Triton kernel: runs in the interpreter), imported without fla's
    package __init__ (which pulls in its layers and models: ~15 s) by standing in bare packages for the parents."""
    import importlib.metadata
    import importlib.util
    import types

    root = importlib.util.find_spec("fla").submodule_search_locations[0]
    for name, sub in (("fla", ""), ("fla.ops", "/ops"), ("fla.ops.kda", "/ops/kda")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__, package.__version__ = [root + sub], importlib.metadata.version("fla-core")
            sys.modules[name] = package
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd


def _varlen_chunk_standin(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, state_v_first,
                          use_qk_l2norm_in_kernel):  # fmt: skip
    """chunk_kda's varlen API (batch 1, cu_seqlens, V-first states) over fla's naive recurrent KDA per sequence
    (fla's chunked kernel needs a GPU driver even under the interpreter)."""
    from moe_export.plugins.gated_delta_scan.inputs import l2norm

    assert state_v_first and output_final_state
    naive = load_fla_naive("ops/kda/naive.py")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    outs, finals = [], []
    for n in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, final = naive.naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=scale,
                                             initial_state=initial_state[n : n + 1].transpose(-1, -2),
                                             output_final_state=True)  # fmt: skip
        outs.append(o)
        finals.append(final.transpose(-1, -2))
    return torch.cat(outs, 1), torch.cat(finals)


def _unused(*args, **kwargs):
    raise AssertionError("the other path was taken")


@inner_triton
@pytest.mark.parametrize("lengths", [[5, 1, 9], [1, 1, 1]])
def test_inner_fla_path_on_the_pool_matches_reference(lengths):
    """`fla_path.kda_pool_fla` against our node reference: prefill (some sequence longer than one token) through
    chunk_kda's varlen API (states gathered from the slots, V-first, scattered back); decode (one token per
    sequence) through fla's real fused recurrent kernel on the pool in place at the slot ids. Slots not in the
    step are left as they were."""
    from moe_export.plugins.gated_delta_scan.fla_path import kda_pool_fla

    gen = torch.Generator().manual_seed(sum(lengths))
    H, K, V, S = 2, 16, 16, 6
    T = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    slots = torch.tensor([4, 0, 2])
    q, k, g = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen) * 2
    v, beta = torch.randn(T, H, V, generator=gen), torch.rand(T, H, generator=gen)
    pool0 = torch.randn(S, H, V, K, generator=gen) * 0.1
    want_o, want_pool = reference.gated_delta_scan_node(q, k, v, g, beta, pool0, cu, slots, K**-0.5, True)
    decode = max(lengths) == 1
    kernels = (_unused, _fla_fused_recurrent()) if decode else (_varlen_chunk_standin, _unused)
    pool = pool0.clone()
    o = kda_pool_fla(q, k, v, g, beta, pool, cu, slots, K**-0.5, True, kernels=kernels)
    close(o, want_o, scan_rtol(T, K, V))
    close(pool, want_pool, scan_rtol(T, K, V))
    assert torch.equal(pool[[1, 3, 5]], pool0[[1, 3, 5]])


# ------------------------------------------------------------------------------- TensorRT side


def test_aot_compile_produces_ptx():
    """The kernel the TensorRT AOT plugin embeds compiles to sm_90 PTX (real compile, no GPU needed)."""
    import triton  # noqa: F401  (test extra: a missing oracle is a broken install, not a skip)
    from moe_export.plugins.gated_delta_scan import triton_kernel

    kernel = triton_kernel.aot_compile("bf16", 2, 128, 128, 128**-0.5, True, True, 90)
    assert kernel.metadata.name == "gated_delta_scan_kernel"
    assert ".entry gated_delta_scan_kernel" in kernel.asm["ptx"]
    assert kernel.metadata.num_warps * 32 > 0


def test_tensorrt_plugin_not_imported_by_package():
    code = (
        "import sys, moe_export.plugins.gated_delta_scan as p\n"
        "from moe_export.plugins.gated_delta_scan import inputs, reference, cpu, onnx_schema, ort, triton_kernel\n"
        "assert 'tensorrt' not in sys.modules, 'tensorrt imported'\n"
        "assert 'moe_export.plugins.gated_delta_scan.tensorrt_plugin' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    package = REPO / "plugins" / "gated_delta_scan"
    importers = [p.name for p in package.glob("*.py") if "import tensorrt" in p.read_text()]
    assert importers == ["tensorrt_plugin.py"]

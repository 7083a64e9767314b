"""short_conv: reference vs torch F.conv1d and transformers' causal_conv1d_fn / causal_conv1d_update
(torch fallbacks), and the CPU, Triton (interpreter, in a subprocess) and ONNX Runtime implementations vs the
reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper

from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.plugins.short_conv import cpu, onnx_schema, ort, reference
from conftest import run_triton_inner_tests
from fp32_reorder import CONV_RTOL, U16

REPO = Path(__file__).resolve().parents[1]


def make_inputs(B, T, C, W=4, seed=0, dtype=torch.float32):
    """x [B, T, C] (dtype), weight [C, 1, W] fp32 as on disk."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, C, generator=gen).to(dtype), torch.randn(C, 1, W, generator=gen)


def close(a, b, rtol=CONV_RTOL):
    err = float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)
    assert err < rtol, err


# --------------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("W", [4, 2, 1])
def test_reference_matches_conv1d(W):
    x, w = make_inputs(2, 11, 5, W)
    y, _ = reference.short_conv(x, w)
    y_ref = F.silu(F.conv1d(x.transpose(1, 2), w, padding=W - 1, groups=5)[..., :11]).transpose(1, 2)
    close(y, y_ref)


def test_reference_with_state_matches_conv1d_on_concatenation():
    """A carried window acts as the W-1 inputs before the sequence; the final state is the last W-1 inputs."""
    x, w = make_inputs(2, 6, 5, seed=1)
    h0 = torch.randn(2, 5, 3)
    y, s = reference.short_conv(x, w, h0, output_final_state=True)
    full = torch.cat([h0, x.transpose(1, 2)], dim=2)  # [B, C, 3 + T]
    y_ref = F.silu(F.conv1d(full, w, groups=5)).transpose(1, 2)
    close(y, y_ref)
    assert torch.equal(s, full[..., -3:])


TRANSFORMERS_SCRIPT = r"""
import sys, torch
sys.modules["fla"] = None  # transformers would otherwise pick fla's Triton kernels
from transformers.models.kimi_linear import modeling_kimi_linear as m
x = torch.load(sys.argv[1])
y = m.causal_conv1d_fn(x["x"].transpose(1, 2), x["w"][:, 0], activation="silu")
state = x["h0"].clone()
y_dec = m.causal_conv1d_update(x["x_dec"].transpose(1, 2), state, x["w"][:, 0], activation="silu")
torch.save(dict(y=y.transpose(1, 2), y_dec=y_dec.transpose(1, 2), state=state), sys.argv[2])
"""


def test_reference_matches_transformers_causal_conv1d(tmp_path):
    """transformers' torch fallbacks (prefill from zeros; one decode step with a state), in a subprocess."""
    import transformers  # noqa: F401  (test extra: a missing oracle is a broken install, not a skip)
    x, w = make_inputs(2, 9, 6, seed=2)
    x_dec = torch.randn(2, 1, 6)
    h0 = torch.randn(2, 6, 3)
    torch.save(dict(x=x, w=w, x_dec=x_dec, h0=h0), tmp_path / "in.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    out = torch.load(tmp_path / "out.pt")
    close(reference.short_conv(x, w)[0], out["y"])
    y_dec, s_dec = reference.short_conv(x_dec, w, h0, output_final_state=True)
    close(y_dec, out["y_dec"])
    assert torch.equal(s_dec, out["state"])


# ------------------------------------------------------------------------------ cpu vs reference

CASES = {
    # name: (B, T, C, W, cu_seqlens)
    "batched": (2, 9, 5, 4, None),
    "varlen_empty_short_long": (1, 40, 6, 4, [0, 2, 2, 3, 40, 40]),
    "leading_empty": (1, 7, 3, 4, [0, 0, 7]),
    "decode": (3, 1, 4, 4, None),
    "decode_varlen": (1, 3, 4, 4, [0, 1, 2, 3]),
    "width_1": (1, 5, 3, 1, [0, 2, 5]),
    "wide_channels": (1, 20, 130, 4, [0, 15, 20]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("with_state", [False, True])
def test_cpu_matches_reference(name, with_state):
    B, T, C, W, cu = CASES[name]
    x, w = make_inputs(B, T, C, W, seed=3)
    cu_t = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, C, W - 1) if with_state else None
    y_ref, s_ref = reference.short_conv(x, w, h0, output_final_state=True, cu_seqlens=cu_t)
    y, s = cpu.short_conv(x, w, h0, output_final_state=True, cu_seqlens=cu_t)
    close(y, y_ref)
    assert torch.equal(s, s_ref)


def test_cpu_bf16_and_2d_weight():
    x, w = make_inputs(1, 8, 4, seed=4, dtype=torch.bfloat16)
    y_ref, _ = reference.short_conv(x, w)
    y, s = cpu.short_conv(x, w[:, 0])
    assert y.dtype == torch.bfloat16 and s is None
    close(y, y_ref)


@pytest.mark.parametrize("impl", [reference, cpu])
def test_state_carried_across_calls(impl):
    """Prefill at once == two prefill calls (second shorter than W-1) == prefill then token-by-token decode."""
    x, w = make_inputs(2, 12, 5, seed=5)
    y_all, s_all = impl.short_conv(x, w, output_final_state=True)
    y1, s1 = impl.short_conv(x[:, :8], w, output_final_state=True)
    y2, s2 = impl.short_conv(x[:, 8:10], w, s1, output_final_state=True)
    y3, s3 = impl.short_conv(x[:, 10:], w, s2, output_final_state=True)
    close(torch.cat([y1, y2, y3], 1), y_all)
    assert torch.equal(s3, s_all)
    s, outs = s1, [y1]
    for t in range(8, 12):
        y_t, s = impl.short_conv(x[:, t : t + 1], w, s, output_final_state=True)
        outs.append(y_t)
    close(torch.cat(outs, 1), y_all)
    assert torch.equal(s, s_all)


def test_rejects_bad_shapes():
    x, w = make_inputs(2, 4, 3)
    with pytest.raises(ValueError):
        cpu.short_conv(x, w, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError):
        cpu.short_conv(x, w, initial_state=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        cpu.short_conv(x, torch.zeros(4, 1, 4))


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


@inner_triton
@pytest.mark.parametrize("name", list(CASES))
def test_inner_triton_matches_reference(name):
    from moe_export.plugins.short_conv import triton_kernel

    B, T, C, W, cu = CASES[name]
    x, w = make_inputs(B, T, C, W, seed=6)
    cu_t = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, C, W - 1)
    y_ref, s_ref = reference.short_conv(x, w, h0, output_final_state=True, cu_seqlens=cu_t)
    y, s = triton_kernel.short_conv(x, w, h0, output_final_state=True, cu_seqlens=cu_t)
    close(y, y_ref)
    assert torch.equal(s, s_ref)


@inner_triton
def test_inner_triton_pool_matches_node_reference():
    """The kernel reaches the window pool only through the pool table (here the pool is row 1
    of two) and advances its slots in place; the other pool is untouched."""
    from moe_export.plugins.pool_table import device_pool_table
    from moe_export.plugins.short_conv import triton_kernel

    x, w, pool, cu, slots = node_inputs(seed=7)
    y_ref, pool_ref = reference.short_conv_node(x, w, pool, cu, slots)
    other, fresh = torch.randn_like(pool), pool.clone()
    other_before, y = other.clone(), torch.empty_like(x)
    triton_kernel.launch(x, w, device_pool_table([other, pool]), 1, cu, slots, y)
    close(y, y_ref)
    assert torch.equal(pool, pool_ref) and torch.equal(other, other_before)
    assert torch.equal(triton_kernel.short_conv_pool(x, w, fresh, cu, slots), y)  # the one-pool wrapper
    assert torch.equal(fresh, pool_ref)


@inner_triton
def test_inner_triton_garbage_table_touches_no_pool():
    """A table row that is not one (wrong check word; null) makes the kernel read and write no pool memory."""
    import triton

    from moe_export.plugins.short_conv import triton_kernel

    x, w, pool, cu, slots = node_inputs(seed=8)
    before = pool.clone()
    C, W = w.shape
    BT, BC, BW = triton_kernel.block_sizes(C, W)
    for row in ([pool.data_ptr(), pool.shape[0], 7], [0, 0, 0]):
        triton_kernel.short_conv_kernel[(triton.cdiv(C, BC), slots.numel())](
            x, w, torch.tensor([row]), cu, slots, 0, x.shape[0], torch.empty_like(x), C=C, W=W, BT=BT, BC=BC, BW=BW)
        assert torch.equal(pool, before)


# -------------------------------------------------------------------------- ONNX schema and ORT


def node_inputs(seed=0, lengths=(3, 0, 7, 1, 2), slots=(4, 0, 2, 5, 1), S=7, C=6, W=4, dtype=torch.float32):
    """x [T, C], weight [C, W], conv_pool [S, C, W-1], cu_seqlens [N+1], slot_ids [N]."""
    x, w = make_inputs(1, sum(lengths), C, W, seed=seed, dtype=dtype)
    pool = torch.randn(S, C, W - 1, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    return x[0], w[:, 0], pool, cu, torch.tensor(slots, dtype=torch.int64)


def onnx_model(act=onnx.TensorProto.FLOAT, pool=onnx.TensorProto.FLOAT, with_function=True):
    vi = helper.make_tensor_value_info
    i64 = onnx.TensorProto.INT64
    inputs = [
        vi("x", act, ["T", "C"]), vi("weight", onnx.TensorProto.FLOAT, ["C", "W"]),
        vi("conv_pool", pool, ["S", "C", "Wm1"]), vi("cu_seqlens", i64, ["N1"]), vi("slot_ids", i64, ["N"]),
    ]  # fmt: skip
    outputs = [vi("y", act, ["T", "C"]), vi("conv_pool_out", pool, ["S", "C", "Wm1"])]
    node = onnx_schema.make_node(*onnx_schema.INPUTS, *onnx_schema.OUTPUTS, name="conv0")
    graph = helper.make_graph([node], "short_conv", inputs, outputs)
    opsets = [helper.make_opsetid("", ort.ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, functions=[ort.function_proto()] if with_function else [])


@pytest.mark.parametrize("with_function", [False, True])
def test_schema_checker_and_strict_shape_inference(with_function):
    onnx_schema.register()
    onnx_schema.register()  # idempotent
    model = onnx_model(with_function=with_function)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_schema_inference_gives_output_types():
    onnx_schema.register()
    model = onnx_model(act=onnx.TensorProto.BFLOAT16, with_function=False)
    del model.graph.output[:]
    model.graph.output.extend([onnx.ValueInfoProto(name="y"), onnx.ValueInfoProto(name="conv_pool_out")])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    assert types["y"].elem_type == onnx.TensorProto.BFLOAT16
    assert [d.dim_param for d in types["y"].shape.dim] == ["T", "C"]
    assert types["conv_pool_out"].elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param for d in types["conv_pool_out"].shape.dim] == ["S", "C", "Wm1"]


def test_make_node_attributes():
    node = onnx_schema.make_node(*onnx_schema.INPUTS, *onnx_schema.OUTPUTS)
    assert node.domain == DOMAIN and node.op_type == "ShortConv"
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {"plugin_version": b"1", "plugin_namespace": b"moe_export"}


def run_ort(model, args):
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {name: a.numpy() for name, a in zip(onnx_schema.INPUTS, args)})


ORT_CASES = {
    "varlen_empty_short_long": dict(lengths=(3, 0, 7, 1, 2), slots=(4, 0, 2, 5, 1)),
    "leading_empty": dict(lengths=(0, 9), slots=(3, 6)),
    "decode": dict(lengths=(1, 1, 1), slots=(5, 2, 0)),
    "width_2": dict(lengths=(4, 1), slots=(1, 0), W=2),
}


@pytest.mark.parametrize("name", list(ORT_CASES))
def test_ort_function_matches_reference(name):
    args = node_inputs(seed=8, **ORT_CASES[name])
    y, pool = run_ort(onnx_model(), args)
    y_ref, pool_ref = reference.short_conv_node(*args)
    close(torch.from_numpy(y), y_ref)
    assert torch.equal(torch.from_numpy(pool), pool_ref)
    untouched = [s for s in range(pool.shape[0]) if s not in ORT_CASES[name]["slots"]]
    assert torch.equal(torch.from_numpy(pool[untouched]), args[2][untouched])


def test_ort_function_fp16_activations_fp32_pool():
    x, w, pool, cu, slots = node_inputs(seed=9)
    x = x.half()
    y, pool_out = run_ort(onnx_model(act=onnx.TensorProto.FLOAT16), [x, w, pool, cu, slots])
    y_ref, pool_ref = reference.short_conv_node(x, w, pool, cu, slots)
    assert y.dtype == np.float16
    close(torch.from_numpy(y), y_ref, 2 * U16)  # fp16 rounding of y on both sides (u16 each) dominates CONV_RTOL
    assert torch.equal(torch.from_numpy(pool_out), pool_ref)


def test_ort_prefill_then_decode_through_pool():
    """Prefill two sequences, then decode steps feeding conv_pool_out back == one long reference call."""
    model = onnx_model()
    x, w = make_inputs(1, 16, 5, seed=10)
    x = x[0]
    pool0 = torch.randn(3, 5, 3)
    slots = torch.tensor([2, 0])
    y_full, pool_full = reference.short_conv_node(x, w[:, 0], pool0, torch.tensor([0, 8, 16]), slots)
    pre = torch.cat([x[:6], x[8:14]])
    y_pre, pool = run_ort(model, [pre, w[:, 0], pool0, torch.tensor([0, 6, 12]), slots])
    outs = [y_pre[:6], y_pre[6:]]
    for t in (6, 7):
        step = torch.stack([x[t], x[8 + t]])
        y_t, pool = run_ort(model, [step, w[:, 0], torch.from_numpy(pool), torch.tensor([0, 1, 2]), slots])
        outs = [np.concatenate([outs[0], y_t[:1]]), np.concatenate([outs[1], y_t[1:]])]
    close(torch.from_numpy(np.concatenate(outs)), y_full)
    assert torch.equal(torch.from_numpy(pool), pool_full)


# ------------------------------------------------------------------------------- TensorRT side


def test_aot_compile_produces_ptx():
    """The kernel the TensorRT AOT plugin embeds compiles to sm_90 PTX (real compile, no GPU needed)."""
    import triton  # noqa: F401  (test extra: a missing oracle is a broken install, not a skip)
    from moe_export.plugins.short_conv import triton_kernel

    kernel = triton_kernel.aot_compile("bf16", 12288, 4, 90)
    assert kernel.metadata.name == "short_conv_kernel"
    assert ".entry short_conv_kernel" in kernel.asm["ptx"]


def test_tensorrt_plugin_not_imported_by_package():
    code = (
        "import sys, moe_export.plugins.short_conv as p\n"
        "from moe_export.plugins.short_conv import inputs, reference, cpu, onnx_schema, ort, triton_kernel\n"
        "assert 'tensorrt' not in sys.modules, 'tensorrt imported'\n"
        "assert 'moe_export.plugins.short_conv.tensorrt_plugin' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    package = REPO / "plugins" / "short_conv"
    importers = [p.name for p in package.glob("*.py") if "import tensorrt" in p.read_text()]
    assert importers == ["tensorrt_plugin.py"]

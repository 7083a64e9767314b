"""Streaming convert-stage transforms: finiteness, MXFP4/FP8 quantization reports, pre-quantized expert
validation, gate-up fusion and per-rank expert stacks."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from conftest import random_source
from moe_export.common.errors import InputError
from moe_export.export.convert.synth import preset_config
from moe_export.graphs.weights import all_tensor_specs, expert_tensor_specs
from moe_export.export.convert import transforms
from moe_export.quantize import fp8, mxfp4


@pytest.fixture(scope="module")
def k3():
    cfg = preset_config("tiny-k3")
    return cfg, random_source(cfg, 0)


@pytest.fixture(scope="module")
def kimi_linear():
    cfg = preset_config("tiny-kimi-linear")
    return cfg, random_source(cfg, 1)


def expert_names(cfg, layer, expert, w):
    return [s.name for s in expert_tensor_specs(cfg, layer, expert) if f".{w}." in s.name]


def test_check_finite_names_the_tensor_and_index():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    transforms.check_finite("a.weight", t)
    t[2, 1] = float("inf")
    t[2, 3] = float("nan")
    with pytest.raises(InputError, match=r"a\.weight: 2 non-finite .*index \[2, 1\]"):
        transforms.check_finite("a.weight", t)
    transforms.check_finite("ids", torch.full((4,), 255, dtype=torch.uint8))
    assert transforms.count_nonfinite(t) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_is_finite(bad, dtype):
    t = torch.randn(1000, 33).to(dtype)
    if bad is not None:
        t[517, 3] = bad
    assert transforms.is_finite(t) == (bad is None)
    assert transforms.is_finite(torch.zeros(0, 4, dtype=dtype)) and transforms.is_finite(torch.ones(3, dtype=torch.int64))


def test_quantize_mxfp4_report():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    packed, scales, rep = transforms.quantize_mxfp4("m.w", w)
    p_ref, s_ref = mxfp4.encode(w)
    assert torch.equal(packed, p_ref) and torch.equal(scales, s_ref)
    err = mxfp4.decode(packed, scales).double() - w.double()
    assert rep.sqnr_db == pytest.approx(10 * math.log10(float((w.double() ** 2).sum() / (err**2).sum())), rel=1e-9)
    assert rep.max_abs_err == pytest.approx(float(err.abs().max()))
    assert rep.rms_err == pytest.approx(float(err.pow(2).mean().sqrt()))
    assert 15 < rep.sqnr_db < 25  # MXFP4 on Gaussian weights: ~18 dB
    d = rep.to_dict()
    json.dumps(d)
    assert d["name"] == "m.w" and d["fmt"] == "mxfp4" and d["shape"] == [64, 128] and d["source_dtype"] == "BF16"


def test_quantize_mxfp4_exact_and_nonfinite():
    grid = mxfp4.decode(torch.randint(0, 256, (4, 32), dtype=torch.uint8), torch.full((4, 2), 120, dtype=torch.uint8))
    rep = transforms.quantize_mxfp4("g", grid)[2]
    assert rep.sqnr_db == math.inf and rep.to_dict()["exact"] and rep.to_dict()["sqnr_db"] is None
    bad = grid.clone()
    bad[1, 5] = float("nan")
    with pytest.raises(InputError, match=r"^g: 1 non-finite"):
        transforms.quantize_mxfp4("g", bad)
    p, s, rep = transforms.quantize_mxfp4("g", bad, allow_nonfinite=True)
    assert s[1, 0] == 255 and rep.nonfinite == 1 and rep.sqnr_db == math.inf
    with pytest.raises(InputError, match=r"g: shape \[4, 48\]"):
        transforms.quantize_mxfp4("g", torch.zeros(4, 48))


def test_quantize_fp8_report_and_edge_blocks():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g).to(torch.bfloat16)
    q, si, rep = transforms.quantize_fp8("d.weight", w)
    q_ref, si_ref = fp8.encode(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(si, si_ref)
    err = fp8.decode(q, si).double() - w.double()
    assert rep.max_abs_err == pytest.approx(float(err.abs().max()))
    assert rep.sqnr_db == pytest.approx(10 * math.log10(float((w.double() ** 2).sum() / (err**2).sum())), rel=1e-9)
    assert rep.sqnr_db > 28 and rep.fmt == "fp8_block128"


def test_validate_prequantized():
    ok = torch.zeros(8, 2, dtype=torch.uint8)
    assert transforms.validate_mxfp4("x.weight_scale", ok, (8, 64), "scale") == 0
    with pytest.raises(InputError, match=r"x\.weight_packed: expected U8 \[8, 32\].*got U8 \[8, 16\]"):
        transforms.validate_mxfp4("x.weight_packed", torch.zeros(8, 16, dtype=torch.uint8), (8, 64), "packed")
    with pytest.raises(InputError, match="got BF16"):
        transforms.validate_mxfp4("x.weight_packed", torch.zeros(8, 32, dtype=torch.bfloat16), (8, 64), "packed")
    nan = ok.clone()
    nan[3, 1] = 255
    with pytest.raises(InputError, match=r"x\.weight_scale: 1 MXFP4 block scale"):
        transforms.validate_mxfp4("x.weight_scale", nan, (8, 64), "scale")
    assert transforms.validate_mxfp4("x.weight_scale", nan, (8, 64), "scale", allow_nonfinite=True) == 1


def test_parse_expert_name():
    assert transforms.parse_expert_name("language_model.model.layers.3.block_sparse_moe.experts.17.w3.weight_scale") == (
        3, 17, "w3", "weight_scale")  # fmt: skip
    assert transforms.parse_expert_name("model.layers.3.block_sparse_moe.shared_experts.up_proj.weight") is None


def test_expert_mxfp4_prequantized_fuses_gate_then_up(k3):
    cfg, src = k3
    i, d = cfg.moe_intermediate_size, cfg.expert_in_dim
    w1p, w1s = (src.get(n) for n in expert_names(cfg, 1, 3, "w1"))
    w3p, w3s = (src.get(n) for n in expert_names(cfg, 1, 3, "w3"))
    fused = transforms.expert_mxfp4(src, cfg, 1, 3, fuse_gate_up=True)
    assert fused.packed.shape == (2 * i, d // 2) and fused.scales.shape == (2 * i, d // 32)
    assert torch.equal(fused.packed, torch.cat([w1p, w3p])) and torch.equal(fused.scales, torch.cat([w1s, w3s]))
    logical = mxfp4.decode(fused.packed, fused.scales)
    assert torch.equal(logical[:i], mxfp4.decode(w1p, w1s)) and torch.equal(logical[i:], mxfp4.decode(w3p, w3s))
    assert [r.fmt for r in fused.reports] == ["mxfp4_prequantized"] * 2
    down = transforms.expert_mxfp4(src, cfg, 1, 3, fuse_gate_up=False)
    w2p, w2s = (src.get(n) for n in expert_names(cfg, 1, 3, "w2"))
    assert torch.equal(down.packed, w2p) and torch.equal(down.scales, w2s)


def test_expert_mxfp4_bf16_is_quantized(kimi_linear):
    cfg, src = kimi_linear
    (w1,), (w3,) = ([src.get(n) for n in expert_names(cfg, 2, 5, w)] for w in ("w1", "w3"))
    fused = transforms.expert_mxfp4(src, cfg, 2, 5, fuse_gate_up=True)
    p1, s1 = mxfp4.encode(w1)
    p3, s3 = mxfp4.encode(w3)
    assert torch.equal(fused.packed, torch.cat([p1, p3])) and torch.equal(fused.scales, torch.cat([s1, s3]))
    assert [r.name for r in fused.reports] == expert_names(cfg, 2, 5, "w1") + expert_names(cfg, 2, 5, "w3")
    assert all(r.fmt == "mxfp4" and r.sqnr_db > 10 for r in fused.reports)


def test_expert_mxfp4_rejects_nan(kimi_linear):
    cfg, src = kimi_linear
    (name,) = expert_names(cfg, 1, 0, "w2")
    bad = transforms_source(src, {name: src.get(name).clone().index_fill_(1, torch.tensor([3]), float("nan"))})
    with pytest.raises(InputError, match=name.replace(".", r"\.")):
        transforms.expert_mxfp4(bad, cfg, 1, 0, fuse_gate_up=False)
    assert transforms.expert_mxfp4(bad, cfg, 1, 0, fuse_gate_up=False, allow_nonfinite=True).reports[0].nonfinite > 0


class transforms_source:
    """A source with some tensors overridden."""

    def __init__(self, base, override):
        self.base, self.override = base, override

    def get(self, name):
        return self.override.get(name, self.base.get(name))


@pytest.mark.parametrize("which", ["k3", "kimi_linear"])
def test_stack_builder_any_feed_order(which, request):
    cfg, src = request.getfixturevalue(which)
    layer, ids = 2, [5, 0, 7]
    names = [s.name for e in ids for s in expert_tensor_specs(cfg, layer, e)]
    random.Random(0).shuffle(names)
    out = {k: torch.full(s, 0xEE, dtype=torch.uint8) for k, s in (
        ("w13_packed", (3, 2 * cfg.moe_intermediate_size, cfg.expert_in_dim // 2)),
        ("w13_scale", (3, 2 * cfg.moe_intermediate_size, cfg.expert_in_dim // 32)),
        ("w2_packed", (3, cfg.expert_in_dim, cfg.moe_intermediate_size // 2)),
        ("w2_scale", (3, cfg.expert_in_dim, cfg.moe_intermediate_size // 32)))}  # fmt: skip
    stack = transforms.ExpertStackBuilder(cfg, layer, ids, out=out)
    for n in names[:-1]:
        stack.feed(n, src.get(n))
    with pytest.raises(InputError, match="incomplete, missing [12]: expert"):
        stack.result()
    stack.feed(names[-1], src.get(names[-1]))
    res = stack.result()
    assert all(res[k] is out[k] for k in out)
    for k, e in enumerate(ids):
        up = transforms.expert_mxfp4(src, cfg, layer, e, fuse_gate_up=True)
        down = transforms.expert_mxfp4(src, cfg, layer, e, fuse_gate_up=False)
        assert torch.equal(res["w13_packed"][k], up.packed) and torch.equal(res["w13_scale"][k], up.scales)
        assert torch.equal(res["w2_packed"][k], down.packed) and torch.equal(res["w2_scale"][k], down.scales)
    assert len(stack.reports) == 9
    assert not stack.wants(expert_names(cfg, layer, 1, "w1")[0]) and not stack.wants(expert_names(cfg, 3, 5, "w1")[0])
    with pytest.raises(InputError, match="not a routed expert of layer 2"):
        stack.feed(expert_names(cfg, layer, 1, "w2")[0], torch.zeros(1))


def test_stack_builder_rejects_bad_out_and_duplicates(k3):
    cfg, _ = k3
    with pytest.raises(InputError, match="duplicate expert ids"):
        transforms.ExpertStackBuilder(cfg, 1, [1, 1])
    with pytest.raises(InputError, match=r"out\['w13_packed'\]"):
        transforms.ExpertStackBuilder(cfg, 1, [1], out={"w13_packed": torch.zeros(1, dtype=torch.uint8)})


def test_transform_tensors_stream(kimi_linear):
    cfg, src = kimi_linear
    specs = all_tensor_specs(cfg)
    pulled: list[str] = []

    def pairs():
        for s in specs:
            pulled.append(s.name)
            yield s.name, src.get(s.name)

    reports: list[transforms.QuantReport] = []
    stream = transforms.transform_tensors(pairs(), cfg, fp8_classes={"dense"}, reports=reports)
    first = next(stream)
    assert len(pulled) == 1 and first[0] == specs[0].name  # lazy: one source tensor at a time
    out = dict([first, *stream])
    n_experts = sum(1 for s in specs if s.weight_class == "routed_experts")
    n_dense = sum(1 for s in specs if s.weight_class == "dense" and s.name.endswith(".weight") and len(s.shape) == 2)
    assert len(out) == len(specs) + n_experts + n_dense
    for s in specs:
        if s.weight_class == "routed_experts":
            base = s.name.rsplit(".", 1)[0]
            p, sc = mxfp4.encode(src.get(s.name))
            assert torch.equal(out[base + ".weight_packed"], p) and torch.equal(out[base + ".weight_scale"], sc)
        elif s.weight_class == "dense" and len(s.shape) == 2:
            q, si = fp8.encode(src.get(s.name))
            assert out[s.name].dtype == torch.float8_e4m3fn and torch.equal(out[s.name + "_scale_inv"], si)
            assert torch.equal(out[s.name].view(torch.uint8), q.view(torch.uint8))
        else:
            assert out[s.name] is src.get(s.name)
    assert len(reports) == n_experts + n_dense
    json.dumps([r.to_dict() for r in reports])


def test_transform_tensors_prequantized_and_nonfinite(k3):
    cfg, src = k3
    specs = [s for s in all_tensor_specs(cfg) if s.layer == 1]
    out = dict(transforms.transform_tensors(((s.name, src.get(s.name)) for s in specs), cfg))
    for s in specs:
        assert out[s.name] is src.get(s.name)
    bad_name = next(s.name for s in specs if s.name.endswith("self_attn.q_proj.weight") or s.name.endswith("q_a_proj.weight"))
    bad = src.get(bad_name).clone()
    bad[0, 0] = float("-inf")
    with pytest.raises(InputError, match=bad_name.replace(".", r"\.") + ": 1 non-finite"):
        list(transforms.transform_tensors([(bad_name, bad)], cfg))
    assert list(transforms.transform_tensors([(bad_name, bad)], cfg, allow_nonfinite=True))[0][1] is bad
    scale_name = expert_names(cfg, 1, 0, "w1")[1]
    nan_scale = src.get(scale_name).clone()
    nan_scale[0, 0] = 255
    with pytest.raises(InputError, match=scale_name.replace(".", r"\.")):
        list(transforms.transform_tensors([(scale_name, nan_scale)], cfg))
    with pytest.raises(InputError, match="not a routed-expert tensor"):
        list(transforms.transform_tensors([(scale_name.replace("experts.0.", "experts.99."), nan_scale)], cfg))

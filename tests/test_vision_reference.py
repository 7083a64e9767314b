"""K3 vision tower reference (graphs/vision.py): hand-derived cases for the position-table resize, the 2-D
RoPE order, the RMSNorm eps and the 2x2 merge order, PyTorch's own nn.RMSNorm / F.interpolate as oracles,
and the whole tower against an independent complex-number formulation of the public MoonViT code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fp32_reorder import vision_reorder_atol
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.export.convert.synth import (
    preset_config,
    preset_hf_config,
    synth_tensor,
    vision_specs,
)
from moe_export.graphs.vision import (
    VISION_NORM_EPS,
    VisionConfig,
    VisionTower,
    apply_rope,
    bilinear_taps,
    position_taps,
    rms_norm,
    rope_angles,
    tpool_merge,
    vision_config,
    vision_tensor_specs,
)


@pytest.fixture(scope="module")
def tower() -> VisionTower:
    cfg = preset_config("tiny-k3")
    vc = vision_config(cfg)
    return VisionTower(vc, {s.name: synth_tensor(cfg, s, 0).float() for s in vision_specs(cfg)})


def test_k3_config_parses_to_the_public_sizes():
    from moe_export.common.model_config import shipped_model_config

    vc = vision_config(shipped_model_config("kimi-k3"))
    assert (vc.hidden_size, vc.num_layers, vc.num_heads, vc.head_dim, vc.merged_dim) == (1024, 27, 12, 128, 4096)
    specs = {s.name: s for s in vision_tensor_specs(vc)}
    assert specs["vision_tower.encoder.blocks.26.wqkv.weight"].shape == (4608, 1024)
    assert specs["vision_tower.patch_embed.pos_emb.weight"].shape == (64, 64, 1024)
    assert specs["mm_projector.proj.2.weight"].shape == (7168, 4096)
    assert all(s.dtype == "BF16" for s in specs.values())
    tower = sum(s.numel for n, s in specs.items() if n.startswith("vision_tower."))
    proj = sum(s.numel for n, s in specs.items() if n.startswith("mm_projector."))
    assert round(tower / 1e6, 1) == 401.2 and round(proj / 1e6, 1) == 46.1  # k3-vision.md's arithmetic


@pytest.mark.parametrize("field,value,match", [
    ("norm_type", "layernorm", "norm_type"), ("linear_bias", True, "no biases"),
    ("pos_emb_interpolation_mode", "bicubic", "bilinear"), ("mm_projector_type", "patchmerger", "patchmergerv2"),
    ("qkv_hidden_size", 30, "head_dim"),
])
def test_config_refuses_what_the_tower_does_not_run(field, value, match):
    hf = preset_hf_config("tiny-k3")
    hf["vision_config"][field] = value
    with pytest.raises(InputError, match=match):
        vision_config(ModelConfig.from_hf_dict(hf))


def test_bilinear_taps_hand_derived():
    # 2 -> 4, half-pixel: source positions -0.25 (clamped to 0), 0.25, 0.75, 1.25 (i0 = i1 = 1)
    i0, i1, lam = bilinear_taps(2, 4)
    assert i0.tolist() == [0, 0, 0, 1] and i1.tolist() == [1, 1, 1, 1]
    assert torch.allclose(lam, torch.tensor([0.0, 0.25, 0.75, 0.25]))  # both taps of the last are row 1
    table = torch.tensor([[1.0, 2.0], [3.0, 4.0]])[:, :, None]  # [2, 2, D=1]
    vc = VisionConfig(14, 2, 2, 4, "bilinear", 1, 1, 1, 4, 4, (2, 2), 1, 1e-5, 1)
    idx, wts = position_taps(vc, 4, 4)
    got = (table.reshape(4, 1)[idx] * wts[..., None]).sum(1).reshape(4, 4)
    row = torch.tensor([1.0, 1.25, 1.75, 2.0])
    want = torch.stack([row, row + 0.5, row + 1.5, row + 2.0])  # rows move by 2 per table row
    assert torch.allclose(got, want)


@pytest.mark.parametrize("h,w", [(8, 8), (3, 5), (2, 40), (37, 9), (64, 2)])
def test_position_taps_equal_torch_interpolate(tower, h, w):
    table = tower.w("vision_tower.patch_embed.pos_emb.weight")
    idx, wts = position_taps(tower.vc, h, w)
    gathered = (table.flatten(0, 1)[idx] * wts[..., None]).sum(1)
    oracle = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
    assert torch.allclose(gathered, oracle[0].permute(1, 2, 0).reshape(h * w, -1), atol=1e-6)
    assert torch.allclose(tower.position(h, w), gathered, atol=1e-6)


def test_rope_order_hand_derived():
    hd = 8  # two frequencies: f0 = 1, f1 = 10000^(-4/8) = 0.01
    ang = rope_angles(3, 5, hd)
    row, col = 2, 3
    assert torch.allclose(ang[row * 5 + col], torch.tensor([col * 1.0, row * 1.0, col * 0.01, row * 0.01]))
    x = torch.zeros(1, 1, hd)
    x[0, 0, 2] = 1.0  # the real part of pair 1 (the row frequency f0)
    a = torch.tensor([[0.1, 0.7, 0.2, 0.3]])
    y = apply_rope(x, a.cos(), a.sin())
    assert torch.allclose(y[0, 0], torch.tensor([0, 0, math.cos(0.7), math.sin(0.7), 0, 0, 0, 0]), atol=1e-7)
    with pytest.raises(InputError, match="RoPE table"):
        rope_angles(513, 2, hd)


def test_norm_eps_settings_match_pytorch_rmsnorm():
    x = torch.full((1, 16), 0.01)
    # current PyTorch: an eps-less nn.RMSNorm uses float32's epsilon (the oracle is PyTorch itself)
    assert torch.allclose(torch.nn.RMSNorm(16)(x), rms_norm(x, torch.ones(16), VISION_NORM_EPS["float32"]))
    assert VISION_NORM_EPS["bfloat16"] == 2**-7
    legacy = rms_norm(x, torch.ones(16), VISION_NORM_EPS["bfloat16"])
    assert torch.allclose(legacy, torch.full((1, 16), 0.01 / math.sqrt(1e-4 + 2**-7)))  # ~0.1125, not ~1
    assert torch.allclose(torch.nn.RMSNorm(16, eps=2**-7)(x), legacy)


def test_merge_order_hand_derived():
    h, w = 4, 6
    x = torch.arange(h * w, dtype=torch.float32)[:, None].repeat(1, 2)  # patch index as feature, D = 2
    m = tpool_merge(x, 1, h, w, (2, 2))
    assert m.shape == (6, 8)
    # token (r, c) of the 2x3 merged grid holds patches (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1)
    assert m[0, ::2].tolist() == [0, 1, 6, 7]
    assert m[4, ::2].tolist() == [14, 15, 20, 21]
    assert m[4, 1::2].tolist() == m[4, ::2].tolist()


def _independent_tower(tw: VisionTower, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """MoonViT3d as the public code writes it: nn.Conv2d patch embed, F.interpolate position table,
    `Rope2DPosEmbRepeated` freqs_cis as complex numbers ([x_j, y_j] per pair) applied by complex
    multiplication, per-head softmax attention, nn.RMSNorm, tpool merge, PatchMergerMLPV2."""
    vc, W = tw.vc, tw.weights
    d, heads, hd = vc.hidden_size, vc.num_heads, vc.head_dim
    conv = torch.nn.Conv2d(3, d, vc.patch_size, vc.patch_size, bias=False)
    conv.weight.data = W["vision_tower.patch_embed.proj.weight"]
    x = conv(patches).view(patches.shape[0], -1)
    table = W["vision_tower.patch_embed.pos_emb.weight"]
    x = x + F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0].permute(1, 2, 0).reshape(h * w, d)
    n = 512 * 512
    flat = torch.arange(n).float()
    freqs = 1.0 / (10000 ** (torch.arange(0, hd, 4)[: hd // 4].float() / hd))
    xc = torch.polar(torch.ones(n, hd // 4), torch.outer(flat % 512, freqs))
    yc = torch.polar(torch.ones(n, hd // 4), torch.outer(flat // 512, freqs))
    cis = torch.cat([xc[..., None], yc[..., None]], -1).reshape(512, 512, -1)[:h, :w].reshape(-1, hd // 2)

    def rot(t):
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * cis[:, None]).flatten(-2)

    norm = torch.nn.RMSNorm(d)
    for i in range(vc.num_layers):
        p = f"vision_tower.encoder.blocks.{i}."
        norm.weight.data = W[p + "norm0.weight"]
        q, k, v = (norm(x) @ W[p + "wqkv.weight"].T).view(-1, 3, heads, hd).unbind(1)
        q, k = rot(q), rot(k)
        outs = [torch.softmax(q[:, j] @ k[:, j].T / math.sqrt(hd), -1) @ v[:, j] for j in range(heads)]
        x = x + torch.cat(outs, -1) @ W[p + "wo.weight"].T
        norm.weight.data = W[p + "norm1.weight"]
        x = x + F.gelu(norm(x) @ W[p + "mlp.fc0.weight"].T, approximate="tanh") @ W[p + "mlp.fc1.weight"].T
    norm.weight.data = W["vision_tower.encoder.final_layernorm.weight"]
    x = norm(x)
    merged = x.view(h // 2, 2, w // 2, 2, d).permute(0, 2, 1, 3, 4).reshape(-1, 4 * d)
    y = F.gelu(merged @ W["mm_projector.proj.0.weight"].T) @ W["mm_projector.proj.2.weight"].T
    post = torch.nn.RMSNorm(y.shape[-1], eps=1e-5)
    post.weight.data = W["mm_projector.post_norm.weight"]
    return post(y)


@torch.no_grad()
def test_tower_equals_independent_formulation_and_packing_keeps_images_apart(tower):
    torch.manual_seed(0)
    sizes = [(6, 10), (4, 4), (12, 2)]
    pix = [torch.randn(h * w, 3, 14, 14) for h, w in sizes]
    together = tower(torch.cat(pix), torch.tensor([[1, h, w] for h, w in sizes]))
    start = 0
    for p, (h, w) in zip(pix, sizes):
        want = _independent_tower(tower, p, h, w)
        got = together[start:start + want.shape[0]]
        atol = vision_reorder_atol(want.numpy(), tower.vc, h * w)  # another formulation: other float32 sum orders
        assert torch.allclose(got, want, atol=atol, rtol=0), (h, w, (got - want).abs().max(), atol)
        start += want.shape[0]
    assert start == together.shape[0]
    with pytest.raises(InputError, match="covers"):
        tower(torch.cat(pix), torch.tensor([[1, 6, 10]]))

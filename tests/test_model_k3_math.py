"""K3-only semantics checked on tiny hand-derived cases (expected values computed here with `math`,
straight from the spec's formulas, not with the model's helpers)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import random_source, tiny_hf_config
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs import model as M


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def situ(g: float, u: float) -> float:
    return 4.0 * math.tanh(g / 4.0) * sig(g) * 25.0 * math.tanh(u / 25.0)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_hf_config("k3"))


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_situ_uses_uncapped_sigmoid_and_linear_cap(cfg):
    gate, up = [0.5, -3.0, 12.0, 0.0], [2.0, -40.0, 0.1, 5.0]
    got = M.gated_act(t(*gate), t(*up), cfg)
    torch.testing.assert_close(got, t(*[situ(g, u) for g, u in zip(gate, up)]))
    capped_sigmoid = 4 * math.tanh(3.0) * sig(4 * math.tanh(3.0)) * 25 * math.tanh(0.1 / 25)
    assert abs(got[2].item() - capped_sigmoid) > 1e-3


def test_router_bias_selects_but_does_not_weight(cfg):
    cfg = dataclasses.replace(cfg, num_experts=3, num_experts_per_token=2, routed_scaling_factor=1.5)
    x = t([1.0, -2.0])
    router = t([1.0, 0.0], [0.0, -0.25], [0.0, 0.5])  # logits 1.0, 0.5, -1.0
    idx, w = M.route(x, router, t(0.0, 0.0, 0.5), cfg)  # biased choice: 0.731, 0.622, 0.769 -> {0, 2}
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [0, 2]
    s0, s2 = sig(1.0), sig(-1.0)
    torch.testing.assert_close(w[0][order], t(1.5 * s0 / (s0 + s2 + 1e-20), 1.5 * s2 / (s0 + s2 + 1e-20)))


def test_grouped_routing_keeps_the_best_groups(cfg):
    """Groups {0, 1} and {2, 3}; the group score is the sum of its top-2 choices, so group 1 wins although
    expert 0 has the best single score."""
    cfg = dataclasses.replace(cfg, num_experts=4, num_experts_per_token=2, num_expert_group=2, topk_group=1,
                              routed_scaling_factor=1.0)
    logits = [3.0, -3.0, 2.0, 1.9]
    idx, w = M.route(t(1.0).view(1, 1), t(*logits).view(4, 1), torch.zeros(4), cfg)
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [2, 3]
    s2, s3 = sig(2.0), sig(1.9)
    torch.testing.assert_close(w[0][order], t(s2 / (s2 + s3), s3 / (s2 + s3)))


def test_latent_moe_normalizes_the_aggregate(cfg):
    cfg = dataclasses.replace(cfg, num_experts=3, num_experts_per_token=2, routed_scaling_factor=1.5)
    ex = {
        0: M.MLPWeights(gate=t([1.0, 0.0]), up=t([0.0, 1.0]), down=t([1.0], [2.0])),
        1: M.MLPWeights(gate=t([1.0, 1.0]), up=t([1.0, 1.0]), down=t([100.0], [100.0])),  # never selected
        2: M.MLPWeights(gate=t([-2.0, 1.0]), up=t([1.0, -1.0]), down=t([-1.0], [3.0])),
    }
    w = M.MoEWeights(
        router=t([1.0, 0.0], [0.0, -0.25], [0.0, 0.5]),
        router_bias=t(0.0, 0.0, 0.5),
        latent_down=t([0.5, 0.0], [0.0, 0.25]),
        latent_norm=t(1.0, 0.5),
        latent_up=t([1.0, 2.0], [3.0, -1.0]),
        shared=M.MLPWeights(gate=t([0.5, 0.5]), up=t([1.0, 0.0]), down=t([1.0], [-1.0])),
        experts=ex,
    )
    x = [1.0, -2.0]
    z = [0.5 * x[0], 0.25 * x[1]]  # latent: [0.5, -0.5]
    s0, s2 = sig(1.0), sig(-1.0)
    w0, w2 = 1.5 * s0 / (s0 + s2), 1.5 * s2 / (s0 + s2)
    y0 = [situ(z[0], z[1]) * d for d in (1.0, 2.0)]
    y2 = [situ(-2 * z[0] + z[1], z[0] - z[1]) * d for d in (-1.0, 3.0)]
    agg = [w0 * a + w2 * b for a, b in zip(y0, y2)]

    def norm(v):
        r = 1 / math.sqrt(sum(e * e for e in v) / len(v) + 1e-5)
        return [e * r * g for e, g in zip(v, (1.0, 0.5))]

    def up(v):
        return [v[0] + 2 * v[1], 3 * v[0] - v[1]]

    shared = [situ(0.5 * x[0] + 0.5 * x[1], x[0]) * d for d in (1.0, -1.0)]
    expected = [a + b for a, b in zip(up(norm(agg)), shared)]
    got = M.moe_layer(t(*x).view(1, 1, 2), w, cfg).view(-1)
    torch.testing.assert_close(got, t(*expected))
    per_expert = [a + b for a, b in zip(up([p + q for p, q in zip(norm([w0 * e for e in y0]), norm([w2 * e for e in y2]))]), shared)]
    assert max(abs(a - b) for a, b in zip(per_expert, expected)) > 1e-2


def test_attn_res_mix_normalized_keys_raw_values():
    w = M.AttnResWeights(norm=t(1.0, 2.0), proj=t(0.5, -1.0))
    snap, prefix = [3.0, 4.0], [1.0, 0.0]

    def score(v):
        r = 1 / math.sqrt(sum(e * e for e in v) / 2 + 1e-5)
        return sum(e * r * n * p for e, n, p in zip(v, (1.0, 2.0), (0.5, -1.0)))

    e1, e2 = math.exp(score(snap)), math.exp(score(prefix))
    expected = [(e1 * a + e2 * b) / (e1 + e2) for a, b in zip(snap, prefix)]
    got = M.attn_res(t([prefix]), [t([snap])], w, 1e-5)
    torch.testing.assert_close(got, t([expected]))


def test_attn_res_schedule(cfg, monkeypatch):
    """Block size 2, five layers: snapshots at layers 0, 2, 4; the pre-attention mix is skipped while there
    are no snapshots; the pre-MLP mix always runs; the final mix sees every snapshot + the prefix."""
    cfg = dataclasses.replace(cfg, num_layers=5, kda_layers=(0, 1, 3), mla_layers=(2, 4), attn_res_block_size=2,
                              hidden_size=2, vocab_size=3)
    calls = []

    def fake_attn_res(prefix, snapshots, w, eps):
        calls.append((w.proj, prefix.flatten()[0].item(), [s.flatten()[0].item() for s in snapshots]))
        return prefix

    monkeypatch.setattr(M, "attn_res", fake_attn_res)
    monkeypatch.setattr(M, "attention", lambda x, w, cfg, cache: torch.full_like(x, w))  # a_i = i + 1
    monkeypatch.setattr(M, "ffn", lambda x, w, cfg: torch.full_like(x, w))  # m_i = 10 (i + 1)
    ATT, MLP, OUT = "attn", "mlp", "out"
    layers = [
        M.LayerWeights(torch.ones(2), torch.ones(2), attn=i + 1.0, ffn=10.0 * (i + 1),
                       attn_res=M.AttnResWeights(torch.ones(2), ATT), mlp_res=M.AttnResWeights(torch.ones(2), MLP))
        for i in range(5)
    ]
    weights = M.ModelWeights(embed=torch.full((3, 2), 0.5), norm=torch.ones(2), lm_head=torch.ones(3, 2),
                             output_res=M.AttnResWeights(torch.ones(2), OUT), layers=layers)
    M.KimiModel(cfg, weights).forward(torch.tensor([[1]]))
    e, a, m = 0.5, [1, 2, 3, 4, 5], [10, 20, 30, 40, 50]
    s2 = a[0] + m[0] + a[1] + m[1]
    s4 = a[2] + m[2] + a[3] + m[3]
    assert calls == [
        (MLP, a[0], [e]),  # layer 0: no pre-attention mix (no snapshot yet); snapshot e; prefix restarts at a0
        (ATT, a[0] + m[0], [e]),
        (MLP, a[0] + m[0] + a[1], [e]),
        (ATT, s2, [e]),  # layer 2 mixes, then snapshots s2
        (MLP, a[2], [e, s2]),
        (ATT, a[2] + m[2], [e, s2]),
        (MLP, a[2] + m[2] + a[3], [e, s2]),
        (ATT, s4, [e, s2]),
        (MLP, a[4], [e, s2, s4]),
        (OUT, a[4] + m[4], [e, s2, s4]),
    ]


def test_kda_gate_uses_a_log_per_head(cfg):
    cfg = dataclasses.replace(cfg, kda_num_heads=2, kda_head_dim=2)
    w = M.KDAWeights(*[None] * 12, A_log=t(math.log(2.0), math.log(0.5)), dt_bias=t(0.1, 0.2, 0.3, 0.4),
                     o_norm=None, o_proj=None)
    raw = [1.0, -1.0, 0.5, 0.0]
    u = [r + b for r, b in zip(raw, (0.1, 0.2, 0.3, 0.4))]
    a = [2.0, 2.0, 0.5, 0.5]  # head 0 -> channels 0, 1; head 1 -> channels 2, 3
    safe = M.kda_gate(t(*raw).view(1, 1, 4), w, cfg).flatten()
    torch.testing.assert_close(safe, t(*[-5.0 * sig(ai * ui) for ai, ui in zip(a, u)]))
    soft = M.kda_gate(t(*raw).view(1, 1, 4), w, dataclasses.replace(cfg, gate_lower_bound=None)).flatten()
    torch.testing.assert_close(soft, t(*[-ai * math.log1p(math.exp(ui)) for ai, ui in zip(a, u)]))


def test_a_log_loader_takes_heads_and_requires_zero_tail(cfg):
    src = random_source(cfg, 0)
    layer = cfg.kda_layers[0]
    name = f"language_model.model.layers.{layer}.self_attn.A_log"
    a_log = src.tensors[name]
    assert a_log.shape == (max(cfg.kda_head_dim, cfg.kda_num_heads),)
    torch.testing.assert_close(M.load_kda(src, layer, torch.float32).A_log, a_log[: cfg.kda_num_heads])
    src.tensors[name] = a_log.clone()
    src.tensors[name][-1] = 0.3
    with pytest.raises(InputError, match="A_log"):
        M.load_kda(src, layer, torch.float32)


def test_mla_latent_norms_use_eps_1e6(cfg):
    cfg = dataclasses.replace(cfg, hidden_size=2, num_heads=1, q_lora_rank=2, kv_lora_rank=2, qk_nope_head_dim=1,
                              qk_rope_head_dim=1, v_head_dim=1)
    w = M.MLAWeights(q_a=t([1.0, 0.0], [0.0, 1.0]), q_a_norm=t(1.0, 1.0), q_b=t([1.0, 0.0], [0.0, 1.0]), q_proj=None,
                     kv_a=t([1.0, 0.0], [0.0, 1.0], [1.0, 2.0]), kv_a_norm=t(1.0, 2.0), kv_b=None, g_proj=None,
                     o_proj=None, indexer=None)
    x = t([1e-3, -1e-3]).view(1, 1, 2)  # mean square 1e-6: eps 1e-6 vs 1e-5 changes the scale ~2.3x
    q, q_latent, latent = M.mla_project(x, w, cfg)
    r = 1e-3 / math.sqrt(1e-6 + 1e-6)
    torch.testing.assert_close(q_latent.flatten(), t(r, -r))
    torch.testing.assert_close(q.flatten(), t(r, -r))
    torch.testing.assert_close(latent.flatten(), t(r, -2 * r, -1e-3))  # k_pe raw: not normalized


def test_gated_rms_norm_order():
    x, gate, weight = [3.0, 4.0], [0.0, 2.0], [2.0, 0.5]
    r = 1 / math.sqrt(12.5 + 1e-5)
    expected = [xi * r * wi * sig(gi) for xi, wi, gi in zip(x, weight, gate)]
    torch.testing.assert_close(M.gated_rms_norm(t(*x), t(*gate), t(*weight), 1e-5), t(*expected))


def test_short_conv_carries_its_window():
    weight = t([1.0, 2.0, 3.0])  # taps oldest -> newest, one channel
    x = t(1.0, 2.0, 3.0, 4.0).view(1, 4, 1)
    silu = [v * sig(v) for v in (3.0, 8.0, 14.0, 20.0)]  # 3*x_t + 2*x_{t-1} + 1*x_{t-2}
    y, window = M.short_conv(x, torch.zeros(1, 2, 1), weight)
    torch.testing.assert_close(y.flatten(), t(*silu))
    assert window.flatten().tolist() == [3.0, 4.0]
    y1, win1 = M.short_conv(x[:, :1], torch.zeros(1, 2, 1), weight)
    y2, win2 = M.short_conv(x[:, 1:], win1, weight)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    assert torch.equal(win2, window)

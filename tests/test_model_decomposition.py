"""The per-layer pieces compose the way an expert-parallel version will use them."""

from __future__ import annotations

import torch
from fp32_reorder import longest_sum, reorder_atol

from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.graphs import model as M


def test_expert_parallel_partials_reduce_to_the_moe_output(synthetic_checkpoint):
    """Two 'ranks' holding half the experts each: summing their latent partials before the latent norm
    reproduces the MoE layer."""
    reader = CheckpointReader(synthetic_checkpoint("tiny-k3"))
    cfg = reader.config
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    half = cfg.num_experts // 2
    full = M.load_moe(reader, layer, torch.float32)
    ranks = [M.load_moe(reader, layer, torch.float32, experts=list(r)) for r in (range(half), range(half, cfg.num_experts))]
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    idx, weights = M.route(x, full.router, full.router_bias, cfg)
    z = x @ full.latent_down.T
    partials = [M.routed_experts(z, idx, weights, r.experts, cfg) for r in ranks]
    assert all(p.abs().sum() > 0 for p in partials)
    got = M.moe_combine(partials[0] + partials[1], x, full, cfg)
    want = M.moe_layer(x[None], full, cfg)[0]
    # the experts' sum split over two ranks: the same float32 terms added in another order
    torch.testing.assert_close(got, want, atol=reorder_atol(want.numpy(), 1, longest_sum(cfg, 1)), rtol=0)


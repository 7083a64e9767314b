"""The model's MXFP4 expert path against transformers' gpt-oss `convert_moe_packed_tensors` decoder."""

from __future__ import annotations

import torch
from conftest import transformers_without_fla
from fp32_reorder import longest_sum, reorder_atol

from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.graphs import model as M
from moe_export.graphs.weights import layer_prefix


def _oracle_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss layout: blocks [E, rows, G, 16] + scales [E, rows, G] -> [E, cols, rows]; back to [rows, cols]."""
    with transformers_without_fla():
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rows, groups = scales.shape
    out = convert_moe_packed_tensors(packed.view(1, rows, groups, 16), scales.view(1, rows, groups), dtype=torch.float32)
    return out[0].T


def test_expert_weights_and_output_match_gpt_oss_decoder(synthetic_checkpoint):
    reader = CheckpointReader(synthetic_checkpoint("tiny-k3"))
    cfg = reader.config
    assert cfg.experts_mxfp4
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    expert = cfg.num_experts - 1
    ours = M.load_expert(reader, layer, expert, torch.float32)
    pre = f"{layer_prefix(cfg, layer)}block_sparse_moe.experts.{expert}."
    ref = {}
    for w in ("w1", "w2", "w3"):
        ref[w] = _oracle_decode(reader.get(pre + w + ".weight_packed"), reader.get(pre + w + ".weight_scale"))
    assert torch.equal(ours.gate, ref["w1"]) and torch.equal(ours.up, ref["w3"]) and torch.equal(ours.down, ref["w2"])
    assert ours.gate.shape == (cfg.moe_intermediate_size, cfg.expert_in_dim)

    # one routed expert with weight 1 through the model's expert sum == SiTU MLP on the oracle weights
    z = torch.randn(5, cfg.expert_in_dim, generator=torch.Generator().manual_seed(0))
    got = M.routed_experts(z, torch.full((5, 1), expert), torch.ones(5, 1), {expert: ours}, cfg)
    g, u = z @ ref["w1"].T, z @ ref["w3"].T
    act = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
    want = act @ ref["w2"].T  # the expert's float32 matmuls, summed in other orders than the model's
    torch.testing.assert_close(got, want, atol=reorder_atol(want.numpy(), 1, longest_sum(cfg, 1)), rtol=0)

"""Prefill == prefill in two chunks == token-by-token decode, and batch rows are independent, for every preset."""

from __future__ import annotations

import pytest
import torch
from conftest import SYNTHETIC_PRESETS
from fp32_reorder import longest_sum, reorder_atol

from moe_export.export.convert.checkpoint import load_model
from moe_export.graphs.model import KDACache, KimiModel, MLACache

T = 13  # longer than the DSA preset's index_topk, so the indexer drops tokens


@pytest.fixture(scope="module", params=SYNTHETIC_PRESETS)
def model(request, synthetic_checkpoint) -> KimiModel:
    return load_model(synthetic_checkpoint(request.param))


def test_prefill_chunks_and_decode_agree(model):
    ids = torch.randint(0, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    full = model(ids)
    assert full.shape == (2, T, model.cfg.vocab_size) and full.dtype == torch.float32
    # chunks, single tokens and a smaller batch change the matmuls' shapes, so their sums' order (float32)
    atol = reorder_atol(full.numpy(), model.cfg.num_layers, longest_sum(model.cfg, T))

    cache = model.new_cache(2)
    chunked = torch.cat([model.prefill(ids[:, :5], cache), model.prefill(ids[:, 5:], cache)], dim=1)
    torch.testing.assert_close(chunked, full, atol=atol, rtol=0)
    assert cache.length == T

    cache = model.new_cache(2)
    steps = torch.stack([model.decode(ids[:, i], cache) for i in range(T)], dim=1)
    torch.testing.assert_close(steps, full, atol=atol, rtol=0)

    for layer, c in enumerate(cache.layers):
        if isinstance(c, MLACache):
            assert c.latent.shape == (2, T, model.cfg.latent_cache_dim)
            assert (c.index_keys is not None) == model.cfg.has_indexer(layer)
        else:
            assert isinstance(c, KDACache) and model.cfg.is_kda(layer)
            assert c.state.dtype == torch.float32
            assert c.q_window.shape == (2, model.cfg.conv_kernel_size - 1, model.cfg.kda_proj_dim)

    torch.testing.assert_close(model(ids[1:]), full[1:], atol=atol, rtol=0)

"""The reference model against transformers' KimiLinearForCausalLM on the tiny-kimi-linear checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import import_hf
from fp32_reorder import longest_sum, reorder_atol

from moe_export.export.convert.checkpoint import load_model
from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.graphs import model as M
from moe_export.runtime.entrypoints.generate import reference_generate

PROMPT = [17, 250, 3, 99, 42, 7, 128, 64, 200, 5, 31, 77, 1, 180, 255, 12, 90, 143, 8, 60]


@pytest.fixture(scope="module")
def pair(synthetic_checkpoint):
    path = synthetic_checkpoint("tiny-kimi-linear")
    hf_mod = import_hf("kimi_linear")
    hf, info = hf_mod.KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every checkpoint tensor loaded, nothing missing
    ours = M.KimiModel.from_source(CheckpointReader(path))
    return hf.eval(), ours


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids)
    assert ref.abs().max() > 1  # a non-degenerate comparison
    # float32 in another summation order than transformers'
    torch.testing.assert_close(got, ref, atol=reorder_atol(ref.numpy(), ours.cfg.num_layers, longest_sum(ours.cfg, len(PROMPT))), rtol=0)


def test_each_layer_kind_matches_transformers(pair):
    """KDA and MLA layers, fed the same normed input, agree with the transformers modules."""
    hf, ours = pair
    cfg = ours.cfg
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for i in (cfg.kda_layers[0], cfg.mla_layers[0]):
        with torch.no_grad():
            attn = hf.model.layers[i].self_attn
            if i in cfg.kda_layers:
                ref = attn(x)
            else:
                mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
                ref = attn(x, attention_mask=mask)[0]
        cache = M.new_cache(cfg, 1).layers[i]
        # one layer's float32 sums in another order than transformers'
        atol = reorder_atol(ref.numpy(), 1, longest_sum(cfg, 9))
        torch.testing.assert_close(M.attention(x, ours.weights.layers[i].attn, cfg, cache), ref, atol=atol, rtol=0)
    moe = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    with torch.no_grad():
        ref = hf.model.layers[moe].mlp(x)
    atol = reorder_atol(ref.numpy(), 1, longest_sum(cfg, 9))
    torch.testing.assert_close(M.ffn(x, ours.weights.layers[moe].ffn, cfg), ref, atol=atol, rtol=0)


def test_greedy_generate_matches_transformers(pair):
    hf, ours = pair
    n = 12
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    got = reference_generate(ours, PROMPT, n, stop_at_eos=False)
    assert got == ref[0, len(PROMPT) :].tolist()


def test_bf16_option_tracks_transformers_bf16(synthetic_checkpoint):
    """Under bf16 a random tiny model flips top-2 expert picks at a few positions (transformers too, not
    always at the same ones: it also rounds the fp32-stored A_log / conv weights), so the check is
    the median per-position error against transformers run in bf16."""
    path = synthetic_checkpoint("tiny-kimi-linear")
    hf = import_hf("kimi_linear").KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ids = torch.tensor([PROMPT[:10]])
    with torch.no_grad():
        ref = hf(ids).logits.float()
    ours = load_model(path, dtype=torch.bfloat16)
    cache = ours.new_cache(1)
    got = ours(ids, cache)
    assert got.dtype == torch.float32 and cache.layers[0].state.dtype == torch.float32
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.median() < 0.06, rel

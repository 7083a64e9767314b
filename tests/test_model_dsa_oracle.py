"""tiny-k3-dsa MLA + lightning-indexer layer against transformers' DeepseekV32Attention / DeepseekV32Indexer.

DeepseekV32 has no output gate and uses RoPE: the oracle gets the identity rotation (cos 1, sin 0) and
the comparison is on the attention output before the gate (the o_proj input); the gated layer output
is then checked against o_proj(pre-gate * sigmoid(g_proj x)).
"""

from __future__ import annotations

import pytest
import torch
from conftest import import_hf
from fp32_reorder import longest_sum, reorder_atol

from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.graphs import model as M
from moe_export.graphs.weights import layer_prefix

T = 12


@pytest.fixture(scope="module")
def setup(synthetic_checkpoint):
    reader = CheckpointReader(synthetic_checkpoint("tiny-k3-dsa"))
    cfg = reader.config
    layer = cfg.mla_layers[0]
    hf_mod = import_hf("deepseek_v32")
    hf_cfg = hf_mod.DeepseekV32Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf_cfg._attn_implementation = "eager"
    attn = hf_mod.DeepseekV32Attention(hf_cfg, layer_idx=0).eval()
    pre = layer_prefix(cfg, layer) + "self_attn."
    state = {n[len(pre) :]: reader.get(n).float() for n in reader.tensor_names() if n.startswith(pre) and "g_proj" not in n}
    attn.load_state_dict(state, strict=True)
    ours = M.load_mla(reader, layer, torch.float32)
    assert ours.indexer is not None and ours.g_proj is not None
    return cfg, attn, ours


def _inputs(cfg, seed):
    x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    cos, sin = torch.ones(1, T, cfg.qk_rope_head_dim), torch.zeros(1, T, cfg.qk_rope_head_dim)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    return x, (cos, sin), mask


def _boundary_tie_free(attn, x, cfg) -> bool:
    """Indexer scores recomputed from the oracle's weights: no exact tie at the top-k boundary."""
    with torch.no_grad():
        idx = attn.indexer
        q = idx.wq_b(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, cfg.index_n_heads, -1)
        k = idx.k_norm(idx.wk(x))
        per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * cfg.index_head_dim**-0.5)
        score = torch.einsum("bth,bths->bts", idx.weights_proj(x) * cfg.index_n_heads**-0.5, per_head)
    for t in range(cfg.index_topk, T):
        top = score[0, t, : t + 1].sort(descending=True).values
        if top[cfg.index_topk - 1] == top[cfg.index_topk]:
            return False
    return True


def test_sparse_mla_matches_deepseek_v32(setup):
    cfg, attn, ours = setup
    assert cfg.index_topk < T  # later queries must drop some past tokens
    seed = next(s for s in range(20) if _boundary_tie_free(attn, _inputs(cfg, s)[0], cfg))
    x, rope, mask = _inputs(cfg, seed)
    captured = {}
    handle = attn.o_proj.register_forward_pre_hook(lambda mod, args: captured.setdefault("y", args[0]))
    with torch.no_grad():
        ref_out, _ = attn(x, position_embeddings=rope, attention_mask=mask)
    handle.remove()

    q, q_latent, latent = M.mla_project(x, ours, cfg)
    keys = M.indexer_keys(x, ours.indexer)
    allowed = M.indexer_select(x, q_latent, keys, ours.indexer, cfg, M.causal_mask(T, T))
    assert (allowed.sum(-1) == torch.arange(1, T + 1).clamp(max=cfg.index_topk)).all()
    pre_gate = M.mla_attend(q, latent, ours, cfg, allowed).reshape(1, T, -1)
    # one attention in float32, transformers' sums in other orders
    torch.testing.assert_close(pre_gate, captured["y"], atol=reorder_atol(captured["y"].numpy(), 1, longest_sum(cfg, T)), rtol=0)

    with torch.no_grad():
        ref_selected = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), rope, mask[:, 0], None)
    for t in range(T):
        assert set(ref_selected[0, t].tolist()) & set(range(t + 1)) == set(allowed[0, t].nonzero().flatten().tolist())

    gated = attn.o_proj(captured["y"] * torch.sigmoid(x @ ours.g_proj.T))
    torch.testing.assert_close(gated, ours_layer_out(x, ours, cfg), atol=reorder_atol(gated.detach().numpy(), 1, longest_sum(cfg, T)), rtol=0)
    assert not torch.allclose(ref_out, gated)  # the gate matters


def ours_layer_out(x, w, cfg):
    cache = M.MLACache(torch.zeros(1, 0, cfg.latent_cache_dim), torch.zeros(1, 0, cfg.index_head_dim))
    with torch.no_grad():
        return M.mla_layer(x, w, cfg, cache)

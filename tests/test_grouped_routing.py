"""Group-limited routing (num_expert_group > 1, topk_group; DeepSeek-V3.2 style) on the tiny-dsa-grouped preset
(16 experts in 4 groups, top-4 inside the best 2 groups): the reference MoE block equals transformers'
DeepseekV32MoE, and a built engine's graph routes the same way (engine logits == reference logits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import import_hf
from fp32_reorder import num_layers, reorder_atol
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.graphs import model as M
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine

PRESET = "tiny-dsa-grouped"
PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]


def whole_chunk(eng: Engine, slot: int, start: int, tokens: list[int]) -> SequenceChunk:
    """A chunk of slot `slot` whose block table is blocks slot*per .. of the engine's pool, enough for it."""
    per = eng.num_blocks // eng.num_slots
    need = -(-(start + len(tokens)) // eng.block_size)
    return SequenceChunk(slot, start, tokens, list(range(slot * per, slot * per + need)))


@pytest.fixture(scope="module")
def reader(synthetic_checkpoint):
    with open_checkpoint(synthetic_checkpoint(PRESET)) as r:
        yield r


def plain_topk_differs(x: torch.Tensor, w: M.MoEWeights, cfg) -> bool:
    """Whether group-limited selection picks other experts than a plain top-k for some row of x."""
    choice = torch.sigmoid(x @ w.router.float().T) + w.router_bias.float()
    plain = choice.topk(cfg.num_experts_per_token, dim=-1).indices.sort(-1).values
    grouped = M.route(x, w.router, w.router_bias, cfg)[0].sort(-1).values
    return bool((plain != grouped).any())


def test_reference_moe_equals_transformers_deepseek_v32(reader):
    cfg = reader.config
    assert (cfg.num_expert_group, cfg.topk_group, cfg.num_experts) == (4, 2, 16)
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    ours = M.load_moe(reader, layer, torch.float32)
    hf_mod = import_hf("deepseek_v32")
    hf_cfg = hf_mod.DeepseekV32Config(
        hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token, n_group=cfg.num_expert_group,
        topk_group=cfg.topk_group, n_shared_experts=cfg.num_shared_experts, norm_topk_prob=cfg.moe_renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor, hidden_act="silu",
    )
    hf = hf_mod.DeepseekV32MoE(hf_cfg).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.float())
        hf.gate.e_score_correction_bias.copy_(ours.router_bias.float())
        for e, ex in ours.experts.items():
            hf.experts.gate_up_proj[e].copy_(torch.cat([ex.gate, ex.up]))
            hf.experts.down_proj[e].copy_(ex.down)
        for proj in ("gate", "up", "down"):
            getattr(hf.shared_experts, f"{proj}_proj").weight.copy_(getattr(ours.shared, proj))
    x = torch.randn(1, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    assert plain_topk_differs(x[0], ours, cfg), "the test inputs must exercise the group limit"
    with torch.no_grad():
        want = hf(x)
    got = M.moe_layer(x, ours, cfg)
    # one MoE layer in float32, HF's sums in other orders: their longest runs over the hidden or expert width
    atol = reorder_atol(want.numpy(), 1, max(cfg.hidden_size, cfg.moe_intermediate_size))
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_engine_graph_routes_by_group(synthetic_checkpoint, tmp_path):
    """tp=1, ep=2 engine vs the reference over a prefill and greedy decode steps."""
    base = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    base.update(name="grouped", model={"source": str(synthetic_checkpoint(PRESET))})
    base["quantization"]["kv_cache"] = "fp32"  # exact cache: the comparison is about the routing
    base["target"]["gpus_per_node"] = 2
    base["parallel"] = {"tp": 1, "ep": 2}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(base))
    rec, _ = load_recipe(tmp_path / "r.yaml")
    build(rec, tmp_path / "engine")
    ref = load_model(synthetic_checkpoint(PRESET))
    cache = ref.new_cache(1)
    eng = Engine(tmp_path / "engine", num_slots=1, threads=1)
    eng.reset_slot(0)
    want = ref.prefill(torch.tensor([PROMPT]), cache)[0, -1]
    got = eng.step(StepBatch.from_sequences([whole_chunk(eng, 0, 0, PROMPT)]))[0]
    for step in range(4):
        # ONNX Runtime's float32 sums in other orders than the reference's
        atol = reorder_atol(want.numpy(), num_layers(eng.model_config), eng.max_seq_len)
        np.testing.assert_allclose(got, want.numpy(), atol=atol, rtol=0, err_msg=f"step {step}")
        token = int(want.argmax())
        want = ref.decode(torch.tensor([token]), cache)[0]
        got = eng.step(StepBatch.from_sequences([whole_chunk(eng, 0, len(PROMPT) + step, [token])]))[0]

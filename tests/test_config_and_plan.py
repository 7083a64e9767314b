"""Model config parsing, recipe validation and the planner (K3 numbers from public sources)."""

import copy
import json
import subprocess
import sys

import pytest
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig, shipped_model_config
from moe_export.common.recipe import load_recipe
from moe_export.export.plan.planner import make_plan
from moe_export.graphs.sharding import Mapping
from moe_export.graphs.weights import all_tensor_specs
from moe_export.recipes import models_dir

K3_TOTAL = 2.78e12  # xinference / model card: 2,779.93 B total incl. the vision tower
K3_ACTIVE = 104e9


def k3_raw() -> dict:
    return json.loads((models_dir() / "kimi-k3.json").read_text())


def test_k3_config_layer_kinds_are_one_based():
    cfg = shipped_model_config("kimi-k3")
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    # 1-based 4, 8, ..., 88, 92, 93 are MLA -> 0-based 3, 7, ..., 87, 91, 92
    assert cfg.mla_layers == tuple(list(range(3, 88, 4)) + [91, 92])
    assert cfg.is_kda(0) and not cfg.is_kda(92)
    assert cfg.weight_prefix == "language_model." and cfg.experts_mxfp4
    assert cfg.latent_cache_dim == 576 and cfg.qk_head_dim == 192
    assert not cfg.is_moe(0) and cfg.is_moe(1) and cfg.is_moe(92)


def test_k3_inventory_matches_public_census():
    cfg = shipped_model_config("kimi-k3")
    specs = all_tensor_specs(cfg)
    # The checkpoint index lists 497,220 tensors including the vision tower and projector (168 tensors).
    assert len(specs) == 497_220 - 168
    trunk = sum(s.numel for s in specs if s.weight_class != "routed_experts")
    assert trunk == 56_743_648_000  # always-active trunk (kimi-k3-in-c README)
    expert0 = [s for s in specs if s.layer == 1 and s.expert == 0]
    assert sum(s.nbytes for s in expert0) == 17_547_264  # one MXFP4 expert on disk
    by_name = {s.name: s for s in specs}
    a_log = by_name["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and a_log.dtype == "F32"
    assert by_name["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == "F32"
    assert by_name["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"].shape == (3584, 96)


def test_k3_plan_numbers():
    rec, _ = load_recipe("h100x64.yaml")
    plan = make_plan(rec)
    assert abs(plan.total_params - K3_TOTAL) / K3_TOTAL < 0.01
    assert abs(plan.active_params - K3_ACTIVE) / K3_ACTIVE < 0.03
    assert plan.fits and len(plan.per_rank) == 64
    r0 = plan.per_rank[0]
    # 14 experts x 92 layers x 33,030,144 weights at exactly 4.25 bits
    assert r0.weight_bytes["routed_experts"] == 14 * 92 * 33_030_144 * 17 // 32
    # MLA latent cache: 576 fp8 values + one E8M0 scale byte per token per MLA layer
    assert r0.state_bytes_per_sequence["mla_latent_cache"] == 24 * 1048576 * (576 + 1)
    assert r0.state_bytes_per_sequence["kda_state"] == 69 * (96 // 8) * 128 * 128 * 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", "from moe_export.runtime.entrypoints.cli import main; main()", *args],
                          capture_output=True, text=True)


def test_plan_cli_json_contract():
    res = run_cli("plan", "--recipe", "h100x64.yaml", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for key in ("total_params", "active_params", "fits", "per_rank"):
        assert key in out
    assert "weight_bytes" in out["per_rank"][0] and "max_sequences" in out["per_rank"][0]


def test_plan_that_cannot_fit_exits_2(tmp_path):
    text = (models_dir().parent / "h100x64.yaml").read_text().replace("memory_gib: 80", "memory_gib: 40")
    p = tmp_path / "small.yaml"
    p.write_text(text)
    res = run_cli("plan", "--recipe", str(p))
    assert res.returncode == 2
    assert "over by" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "edit, expect",
    [
        ("target:\n  gpu: h100\n  nodes: 8\n  gpus_per_node: 8\n  bogus: 1\n", "target.bogus: unknown key"),
        ("target:\n  gpu: tpu\n  nodes: 1\n  gpus_per_node: 8\n", "target.gpu"),
        ("target:\n  gpu: h100\n  nodes: 1\n  gpus_per_node: 8\nparallel:\n  tp: 3\n", "parallel.tp=3"),
        ("target:\n  gpu: h100\n  nodes: 1\n  gpus_per_node: 8\nlimits:\n  max_seq_len: 2000000\n", "limits.max_seq_len"),
    ],
)
def test_bad_recipes_name_file_line_and_field(tmp_path, edit, expect):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nmodel:\n  source: x\n  config: kimi-k3\n" + edit)
    with pytest.raises(InputError) as err:
        load_recipe(p)
    assert expect in str(err.value)
    assert f"{p}:" in str(err.value)


def test_bad_recipe_cli_no_traceback(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nmodel:\n  source: x\ntarget:\n  gpu: h100\n  nodes: 1\n  gpus_per_node: 8\n  colour: red\n")
    res = run_cli("plan", "--recipe", str(p))
    assert res.returncode == 2
    assert f"{p}:8: target.colour: unknown key" in res.stderr
    assert "Traceback" not in res.stderr


def test_ep_not_dividing_experts_is_refused(tmp_path):
    text = (models_dir().parent / "h100x64.yaml").read_text().replace("nodes: 8", "nodes: 6").replace("ep: 64", "ep: 48")
    p = tmp_path / "ep.yaml"
    p.write_text(text)
    rec, _ = load_recipe(p)
    with pytest.raises(InputError, match="num_experts=896 is not divisible by ep=48"):
        make_plan(rec)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda c: c.update(model_type="llama"), "unsupported model_type 'llama'"),
        (lambda c: c["text_config"]["linear_attn_config"]["kda_layers"].remove(1), "in neither (1-based): [1]"),
        (lambda c: c["text_config"]["linear_attn_config"]["kda_layers"].append(4), "in both (1-based): [4]"),
        (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[0]), "outside 1..93"),
        (lambda c: c["text_config"].pop("hidden_size"), "missing required field 'hidden_size'"),
        (lambda c: c["text_config"].update(hidden_size=7000), "'hidden_size' (7000) must be a multiple of 32"),
        (lambda c: c.pop("text_config"), "needs a 'text_config'"),
    ],
)
def test_inconsistent_configs_name_the_field(mutate, expect):
    raw = copy.deepcopy(k3_raw())
    mutate(raw)
    with pytest.raises(InputError) as err:
        ModelConfig.from_hf_dict(raw)
    assert expect in str(err.value)


def test_kimi_linear_config():
    cfg = shipped_model_config("kimi-linear-48b-a3b")
    assert cfg.q_lora_rank is None and not cfg.mla_use_output_gate and cfg.gate_lower_bound is None
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert cfg.routed_expert_hidden_size is None and cfg.attn_res_block_size is None


def test_dsa_shared_indexer_layers():
    raw = copy.deepcopy(k3_raw())
    t = raw["text_config"]
    t.update(index_n_heads=64, index_head_dim=128, index_topk=2048)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.has_dsa and cfg.index_shared_layers == () and all(cfg.has_indexer(i) for i in cfg.mla_layers)
    pattern = "".join("S" if i in (7, 92) else "F" for i in range(93))  # 0-based MLA layers 7 and 92 shared
    t["index_topk_pattern"] = pattern
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.index_shared_layers == (7, 92) and not cfg.has_indexer(92) and cfg.has_indexer(3)
    names = {s.name for s in all_tensor_specs(cfg, include_experts=False)}
    assert "language_model.model.layers.3.self_attn.indexer.wk.weight" in names
    assert "language_model.model.layers.7.self_attn.indexer.wk.weight" not in names
    t["index_topk_pattern"] = "S" + "F" * 92
    t["linear_attn_config"]["full_attn_layers"] = [1] + t["linear_attn_config"]["full_attn_layers"]
    t["linear_attn_config"]["kda_layers"].remove(1)
    with pytest.raises(InputError, match="first MLA layer, cannot be 'shared'"):
        ModelConfig.from_hf_dict(raw)
    t["index_topk_pattern"] = "FX"
    with pytest.raises(InputError, match="'index_topk_pattern' must give 'full' or 'shared'"):
        ModelConfig.from_hf_dict(raw)


def test_one_pool_arithmetic_and_k3_sequences_that_fit():
    """pool_sizes: memory after weights and reserve pays max_batch slots, the rest / bytes per block = blocks;
    the plan reports cache tokens per rank and how many 64k / 1M sequences fit (K3 on h100x64 and h200x32: fp8
    cache, 576 latent values x 24 MLA layers, 1 B per value + a 1-byte scale per row)."""
    from moe_export.export.plan.planner import pool_sizes

    pools = pool_sizes(10_000, block_size=4, num_slots=3, bytes_per_slot=1000, bytes_per_token=100)
    assert (pools.num_blocks, pools.cache_tokens) == (17, 68)
    assert pools.sequences_that_fit(16) == 3 and pools.sequences_that_fit(20) == 3 and pools.sequences_that_fit(30) == 2
    assert pool_sizes(2_000, block_size=4, num_slots=3, bytes_per_slot=1000, bytes_per_token=100).num_blocks == 0
    for recipe, per_token in (("h100x64.yaml", 24 * (576 + 1)), ("h200x32.yaml", 24 * (576 + 1))):
        rec, _ = load_recipe(recipe)
        plan = make_plan(rec)
        out = plan.to_dict()
        worst = plan.pool_sizes()
        assert worst.bytes_per_token == per_token
        free = min(r.free_bytes for r in plan.per_rank)
        assert worst.num_blocks == (free - rec.limits.max_batch * worst.bytes_per_slot) // (64 * per_token)
        assert out["cache_tokens_per_rank"] == worst.num_blocks * 64
        assert out["sequences_that_fit"]["1048576"] >= 1
        assert out["sequences_that_fit"]["65536"] == min(rec.limits.max_batch, worst.num_blocks // (65536 // 64))
        assert out["per_rank"][0]["num_blocks"] >= worst.num_blocks
    res = run_cli("plan", "--recipe", "h200x32.yaml")
    assert res.returncode == 0 and "cache per rank:" in res.stdout and "1,048,576 tokens" in res.stdout


def test_too_many_slots_for_one_full_sequence_is_refused(tmp_path):
    """h100x64 with 160 slots: weights fit, but the slots leave less than one 1M-token cache: exit 2, saying so."""
    text = (models_dir().parent / "h100x64.yaml").read_text().replace("max_batch: 24", "max_batch: 160")
    assert "max_batch: 160" in text
    p = tmp_path / "slots.yaml"
    p.write_text(text)
    res = run_cli("plan", "--recipe", str(p))
    assert res.returncode == 2 and "lower limits.max_batch" in res.stderr and "Traceback" not in res.stderr


def test_plan_memory_view_per_gpu_and_build_refusal(tmp_path):
    """The plan shows weights, pools, engine activation memory and plugin workspaces per GPU, and the
    TensorRT build refuses a recipe whose total does not fit (h100x64 with bf16 cache pools: the 1M-token
    sequence no longer fits once ~10 GiB of activations are counted)."""
    from moe_export.export.plan.planner import GIB
    from moe_export.export.backends.tensorrt.engine import check_fits

    rec, _ = load_recipe("h100x64.yaml")
    plan = make_plan(rec)
    view = plan.per_rank[0].memory
    assert {"weights", "state_slots", "cache_blocks", "activations", "plugin_workspaces", "reserve"} <= set(view)
    parts = ("weights", "state_slots", "cache_blocks", "activations", "plugin_workspaces", "nccl_buffers",
             "vision_activations", "reserve")
    assert view["total"] == sum(view[k] for k in parts) and view["capacity"] == 81_559 * 2**20  # H100's NVML total
    assert 0 <= view["capacity"] - view["total"] < plan.pool_sizes().bytes_per_block + 64 * 2**20
    assert 5 * GIB < view["activations"] < 20 * GIB and view["workspace.moe_mxfp4"] > 0
    assert view["plugin_workspaces"] == sum(v for k, v in view.items() if k.startswith("workspace."))
    assert check_fits(rec, 0) == view
    cpu = make_plan(rec.model_copy(update={"backend": "onnxruntime"})).per_rank[0].memory
    assert cpu["activations"] == 0 and cpu["plugin_workspaces"] == 0  # ORT temporaries live in the reserve
    bf16 = rec.model_copy(update={"quantization": rec.quantization.model_copy(update={"kv_cache": "bf16"})})
    with pytest.raises(InputError, match="does not fit"):
        check_fits(bf16, 0)
    # wide EP (dp layout): the all-to-all's static buffers, R = 64 x ceil(8192 / 8) rows of K3's 3,584-wide latent
    # (received bf16, the expert op's bf16 partial sums) and top-16 ids (int64) and weights (fp32), plus
    # send_rows [T x 16] int64; and the plugins' temporaries: packed rows (3,584 x 2 + 16 x 8 bytes, padded to 16)
    # sent (1,024 tokens x 16 ranks) and received (R), and the bf16 rows sent back
    rows, k, sent = 64 * -(-rec.limits.max_num_tokens // 8), 16, 1024 * 16
    assert rec.limits.max_num_tokens == 8192
    engine = rows * (3584 * (2 + 2) + k * (8 + 4)) + 8192 * k * 8
    temporaries = (sent + rows) * 7296 + sent * 3584 * 2
    assert view["workspace.moe_all_to_all"] == engine + temporaries
    tp_layout = make_plan(rec.model_copy(update={"parallel": rec.parallel.model_copy(update={"attention": "tp"})}))
    assert "workspace.moe_all_to_all" not in tp_layout.per_rank[0].memory
    res = run_cli("plan", "--recipe", "h100x64.yaml")
    assert res.returncode == 0 and "engine activations" in res.stdout and "moe_mxfp4" in res.stdout
    assert "moe_all_to_all" in res.stdout


def test_plan_budgets_what_an_h100_exposes_and_reports_margins_and_host_peak():
    """The plan budgets the 79.65 GiB an H100 "80 GB" exposes (not 80), counts NCCL's buffers (the dp
    layout's all-to-all peers included) and the vision tower's activations beside the reserve, and reports the
    usable bytes, the margin beyond one max_seq_len sequence, and the host memory peak per rank (the plan streamed
    to disk: at most 1.5 x the rank's weights; twice them with bindings that build into one plan buffer)."""
    from moe_export.export.plan.memory import NCCL_BUFFSIZE, nccl_buffer_bytes

    rec, _ = load_recipe("h100x64.yaml")
    res = run_cli("plan", "--recipe", "h100x64.yaml", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["fits"] and out["usable_gpu_bytes"] == 81_559 * 2**20 < rec.memory_bytes
    assert 0 < out["margin_bytes"] < 2 * 2**30
    assert out["host_peak_bytes_per_rank"] <= 1.5 * out["weight_bytes_per_rank"]
    assert out["host_peak_bytes_per_rank_plan_buffer"] > 1.5 * out["weight_bytes_per_rank"]
    rank0 = out["per_rank"][0]
    view = rank0["memory"]
    assert view["vision_activations"] == rank0["vision_activation_bytes"] > 0
    mapping = Mapping(64, 0, 8, 64, "dp")
    assert view["nccl_buffers"] == nccl_buffer_bytes(mapping) > 63 * 2 * NCCL_BUFFSIZE
    assert nccl_buffer_bytes(Mapping(64, 0, 8, 64, "tp")) < view["nccl_buffers"]
    cpu = make_plan(load_recipe("tiny-cpu.yaml")[0])  # ONNX Runtime ranks talk over MPI: no NCCL buffers
    assert all(r.memory["nccl_buffers"] == 0 for r in cpu.per_rank)
    # the margin is what is left once one max_seq_len sequence's blocks are taken
    blocks = -(-rec.limits.max_seq_len // 64)
    bytes_per_block = view["cache_blocks"] // rank0["num_blocks"]
    assert out["margin_bytes"] == min(
        r["free_bytes"] - r["num_slots"] * (r["state_bytes_per_sequence"]["kda_state"]
                                            + r["state_bytes_per_sequence"]["conv_state"]) - blocks * bytes_per_block
        for r in out["per_rank"])  # fmt: skip
    text = run_cli("plan", "--recipe", "h100x64.yaml").stdout
    assert "usable GPU memory per rank 79.65 GiB" in text and "margin beyond one max_seq_len" in text
    assert "host memory peak per rank" in text and "dp decode step" in text


def test_planning_a_tensorrt_recipe_needs_no_triton():
    """Planning imports the plugins' pure `sizes.py` for byte arithmetic, never a Triton kernel module: with
    triton made unimportable, h100x64.yaml (TensorRT, the MoE workspace) still plans, to the
    same workspaces as the kernels' own arithmetic."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from moe_export.common.recipe import load_recipe\n"
        "from moe_export.export.plan.planner import make_plan\n"
        "import moe_export.graphs.onnx_export\n"
        "plan = make_plan(load_recipe('h100x64.yaml')[0])\n"
        "view = plan.per_rank[0].memory\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None], 'triton imported'\n"
        "print(view['workspace.moe_mxfp4'], plan.fits)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    moe, fits = r.stdout.split()
    assert int(moe) > 0 and fits == "True"

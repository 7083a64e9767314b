"""Shared test fixtures: synthetic checkpoints, in-memory random weights, and the transformers oracle."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import all_tensor_specs

SYNTHETIC_PRESETS = ("tiny-k3", "tiny-k3-dsa", "tiny-kimi-linear")


@contextlib.contextmanager
def transformers_without_fla() -> Iterator[object]:
    """Import transformers with `fla` hidden, so its Kimi Linear / Qwen3-Next modules bind the torch
    fallbacks instead of fla's Triton kernels (which fail on CPU). Modules imported inside the block keep
    the fallback; `fla` and its submodules are restored afterwards."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
    try:
        yield importlib.import_module("transformers")
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def import_hf(module: str) -> object:
    """A transformers modeling module (e.g. 'kimi_linear') imported fresh with fla hidden."""
    name = f"transformers.models.{module}.modeling_{module}"
    with transformers_without_fla():
        sys.modules.pop(name, None)
        return importlib.import_module(name)


class DictSource:
    """A CheckpointReader stand-in over an in-memory dict of tensors (stored dtypes)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def random_source(cfg: ModelConfig, seed: int = 0) -> DictSource:
    """Random weights for every tensor the config implies, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in all_tensor_specs(cfg):
        name, shape = spec.name, spec.shape
        if spec.dtype == "U8":
            low, high = (120, 125) if name.endswith("weight_scale") else (0, 256)
            t = torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)
        elif name.endswith("A_log"):  # one value per head, zero tail
            t = torch.zeros(shape)
            t.view(-1)[: cfg.kda_num_heads] = torch.rand(cfg.kda_num_heads, generator=gen) * 2 - 1
        elif name.endswith(("dt_bias", "e_score_correction_bias", "conv1d.weight")):
            t = torch.randn(shape, generator=gen) * 0.5
        elif len(shape) == 1:  # norm weights ~ 1, LayerNorm bias ~ 0
            t = torch.randn(shape, generator=gen) * (0.1 if name.endswith("bias") else 0.2) + (0 if name.endswith("bias") else 1)
        else:
            t = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        out[spec.name] = t.to({"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}[spec.dtype])
    return DictSource(cfg, out)


def tiny_hf_config(kind: str) -> dict:
    """HF config dicts of small models: 'k3' (latent MoE, SiTU, attention residuals, safe gate),
    'k3-dsa' (k3 plus a DSA indexer) and 'kimi-linear' (plain residual, softplus gate, SwiGLU)."""
    text = {
        "model_type": "kimi_linear",
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "intermediate_size": 96,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 32,
        "num_shared_experts": 1,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.5,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3, 6],
        },
    }
    if kind == "kimi-linear":
        for key in ("routed_expert_hidden_size", "latent_moe_use_norm", "attn_res_block_size",
                    "activation_situ_beta", "activation_situ_linear_beta", "mla_use_output_gate"):
            del text[key]
        text.update(hidden_act="silu", q_lora_rank=None)
        text["linear_attn_config"] = {k: v for k, v in text["linear_attn_config"].items()
                                      if k not in ("use_full_rank_gate", "gate_lower_bound")}
        return text
    if kind == "k3-dsa":
        text.update(index_n_heads=2, index_head_dim=16, index_topk=3)
    return {"model_type": "kimi_k3", "text_config": text, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


@pytest.fixture(scope="session")
def synthetic_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """preset name -> directory of a synthetic checkpoint written once per session (seed 0)."""
    from moe_export.export.convert.synth import write_synthetic_checkpoint

    made: dict[str, object] = {}

    def get(preset: str):
        if preset not in made:
            out = tmp_path_factory.mktemp(preset)
            write_synthetic_checkpoint(preset, out, seed=0)
            made[preset] = out
        return made[preset]

    return get


def pytest_collection_modifyitems(config, items):
    """Triton kernel tests (`triton_inner`) need TRITON_INTERPRET=1 set before triton is imported, so each
    plugin's `test_triton_in_interpreter_subprocess` runs them in a fresh process; in this process they
    are deselected (not skipped: they do run, and fail that test if they fail)."""
    if os.environ.get("MOE_EXPORT_TRITON_INNER") == "1":
        return
    inner = [item for item in items if item.get_closest_marker("triton_inner")]
    if inner:
        config.hook.pytest_deselected(items=inner)
        items[:] = [item for item in items if not item.get_closest_marker("triton_inner")]


class TextOnly:
    """Logits processor masking the special tokens other than `keep` (reserved ids included): a random-weight
    model then writes text between markers, as a trained one does (a stray reserved token carries no text, so
    no message can hold it). A thinking budget still forces its close marker."""

    def __init__(self, tokenizer, keep: set[int]) -> None:
        self.mask = torch.tensor([tokenizer.is_special(i) and i not in keep for i in range(tokenizer.vocab_size)])

    def __call__(self, _ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(self.mask, float("-inf"))


class OpensThink:
    """Logits processor for K2-family engines: the first output token is `<think>`, as K2-Thinking opens every
    answer (its generation prompt does not; a random-weight model never would). Nothing for K3, whose
    generation prompt opens the think element."""

    def __init__(self, tokenizer, family: str) -> None:
        self.think = tokenizer.encode_special("<think>") if family == "k2" else None

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.think is None or ids:
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[self.think] = 0.0
        return out


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `moe-export ARGS` in process through the console entry point: (exit code, stdout, stderr)."""
    from moe_export.runtime.entrypoints.cli import main

    old = sys.argv
    sys.argv = ["moe-export", *args]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def run_triton_inner_tests(test_file: str) -> None:
    """Run `test_file`'s `triton_inner` tests in a fresh pytest process with TRITON_INTERPRET=1 (it must be
    set before triton is imported); fail if any fails or none ran."""
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_EXPORT_TRITON_INNER="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", "inner_triton"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))), env=env, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def load_fla_naive(relpath: str):
    """One of fla's pure-torch `naive.py` oracles (e.g. 'ops/kda/naive.py'), loaded by file path so none of
    fla's Triton-backed modules is imported. fla is in the test extra: missing means a broken install."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("fla")
    assert spec is not None, "flash-linear-attention (test extra) is not installed"
    path = Path(spec.submodule_search_locations[0]) / relpath
    assert path.exists(), f"this fla has no {relpath}"
    mod_spec = importlib.util.spec_from_file_location("_fla_oracle_" + relpath.replace("/", "_")[:-3], path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def page_cache(
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slot-addressed cache [S, L, D] (sequence n in slot slot_ids[n]) as the paged ops take it.

    Returns (pool [NB, block_size, D] in `dtype`, new rows [T, D] fp32 rounded to `dtype`, block_tables
    [N, B]; `dtype` torch.uint8 means fp8 rows, a pool [NB, block_size, D + 1] of `fp8_cache.encode_rows`): each
    sequence gets distinct
    blocks in shuffled order (plus spare blocks and a -1 padding column), its positions before the step's
    chunk are written to the pool, the step's own rows go to `new`. Every other pool row, including the
    pool rows at the step's own positions, is NaN, so an implementation reading the wrong place fails."""
    gen = torch.Generator().manual_seed(seed)
    n_seq = slot_ids.shape[0]
    ends = [int(positions[cu_seqlens[n + 1] - 1]) + 1 if cu_seqlens[n + 1] > cu_seqlens[n] else 0 for n in range(n_seq)]
    starts = [int(positions[cu_seqlens[n]]) if cu_seqlens[n + 1] > cu_seqlens[n] else 0 for n in range(n_seq)]
    need = [max(1, -(-e // block_size)) for e in ends]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((n_seq, max(need) + 1), -1, dtype=torch.int64)
    pool = torch.full((num_blocks, block_size, cache.shape[-1]), float("nan"))
    used = 0
    for n in range(n_seq):
        tables[n, : need[n]] = order[used : used + need[n]]
        used += need[n]
        for p in range(starts[n]):
            pool[tables[n, p // block_size], p % block_size] = cache[slot_ids[n], p]
    slot_of_token = slot_ids[torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(positions.shape[0]), right=True)]
    new = cache[slot_of_token, positions]
    if dtype == torch.uint8:
        from moe_export.quantize import fp8_cache

        return fp8_cache.encode_rows(pool), fp8_cache.round_rows(new), tables
    return pool.to(dtype), new.to(dtype).float(), tables


@pytest.fixture(scope="session")
def default_engine(tmp_path_factory: pytest.TempPathFactory):
    """The embedded default recipe (tiny-cpu.yaml) built as shipped: tiny-k3 on 4 ranks (tp 2, ep 2)."""
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    rec, _ = load_recipe("tiny-cpu.yaml")
    out = tmp_path_factory.mktemp("default-engine") / rec.name
    build(rec, out)
    return out


@pytest.fixture(scope="session")
def runtime_engine(tmp_path_factory: pytest.TempPathFactory):
    """(preset, tp, ep, world, max_num_tokens=64, attention="tp", backend="onnxruntime", checkpoints_per_slot=None)
    -> engine directory built once per session from tiny-cpu.yaml with small runtime limits (max_batch 6,
    max_seq_len 1024, max_num_tokens, block_size 16, thinking caps 6/12/20, fp32 cache pools; the recipe's default
    checkpoints_per_slot unless given)."""
    import yaml
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    root = tmp_path_factory.mktemp("runtime-engines")
    built: dict[tuple, object] = {}

    def get(preset: str = "tiny-k3", tp: int = 2, ep: int = 2, world: int = 4, max_num_tokens: int = 64,
            attention: str = "tp", backend: str = "onnxruntime", checkpoints_per_slot: int | None = None):
        key = (preset, tp, ep, world, max_num_tokens, attention, backend, checkpoints_per_slot)
        if key not in built:
            from pathlib import Path

            data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
            data["name"] = (f"rt-{preset}-tp{tp}-ep{ep}-w{world}" + (f"-t{max_num_tokens}" if max_num_tokens != 64 else "")
                            + (f"-{attention}" if attention != "tp" else "") + (f"-{backend}" if backend != "onnxruntime" else "")
                            + (f"-c{checkpoints_per_slot}" if checkpoints_per_slot is not None else ""))
            data["model"] = {"source": f"synthetic:{preset}"}
            data["target"]["gpus_per_node"] = world
            data["parallel"] = {"tp": tp, "ep": ep, "attention": attention}
            data["backend"] = backend
            data["limits"].update({"max_batch": 6, "max_seq_len": 1024, "max_num_tokens": max_num_tokens, "block_size": 16})
            if checkpoints_per_slot is not None:
                data["limits"]["checkpoints_per_slot"] = checkpoints_per_slot
            data["thinking"] = {"low": 6, "high": 12, "max": 20}
            data["quantization"]["kv_cache"] = "fp32"  # exact parity with the fp32 reference (bf16 pools: test_engine_parity)
            path = root / f"{data['name']}.yaml"
            path.write_text(yaml.safe_dump(data))
            rec, _ = load_recipe(path)
            build(rec, root / rec.name)
            built[key] = root / rec.name
        return built[key]

    return get


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    """family ("k3", "k2") -> the synthetic Kimi-format tokenizer of that family (vocab 4096)."""
    from moe_export.export.convert.synth import write_synthetic_tokenizer
    from moe_export.runtime.tokenizer import load_tokenizer

    out = {}
    for family in ("k3", "k2"):
        d = tmp_path_factory.mktemp(family)
        write_synthetic_tokenizer(d, family, 4096)
        out[family] = load_tokenizer(d)
    return out



def write_engine_config(folder, backend: str = "onnxruntime"):
    """A valid engine config.json (tiny-k3 under the tiny-cpu recipe) in `folder`, without building anything;
    returns its EngineConfig."""
    from moe_export.common.engine_config import EngineConfig
    from moe_export.common.recipe import load_recipe
    from moe_export.export.plan.planner import engine_memory
    from moe_export.export.convert.synth import preset_config

    recipe = load_recipe("tiny-cpu.yaml")[0].model_copy(update={"backend": backend})
    model = preset_config("tiny-k3")
    cfg = EngineConfig.from_recipe(recipe, model, version="test", files={}, weight_classes={},
                                   memory=engine_memory(recipe, model))
    cfg.write(folder)
    return cfg

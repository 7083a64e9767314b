"""Synthetic Hugging Face checkpoints with random, well-scaled weights for the Kimi family.

`write_synthetic_checkpoint(preset, out_dir, seed)` writes config.json, sharded safetensors with
`model.safetensors.index.json`, a Kimi tiktoken tokenizer (`write_synthetic_tokenizer`) and a LICENSE, into
a temporary directory that is renamed into place at the end. The output is a pure function of (preset,
seed): every tensor comes from its own `torch.Generator`, seeded from sha256(seed, tensor name), and headers
are written with sorted keys. Tensors follow the inventory of `moe_export.graphs.weights` and are generated
and written one at a time (each shard is streamed: header first, then each tensor's bytes).

Values: linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights 1 +- 0.1, KDA A_log =
log U(1, 16) per head, dt_bias as transformers' KDA init, small router bias; BF16 except the classes
the checkpoint stores in F32; K3 routed experts are MXFP4 (compressed-tensors mxfp4-pack-quantized).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from moe_export.common.atomic import atomic_write_bytes, atomic_write_json
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.export.convert.checkpoint import INDEX_FILE
from moe_export.graphs.tokens import (
    END_OF_MESSAGE,
    FAMILY_SPECIAL_NAMES,
    MEDIA_PAD,
    NUM_RESERVED_SPECIAL,
    TIKTOKEN_FILE,
    TOKENIZER_CONFIG,
)
from moe_export.graphs.vision import (
    K3_MEDIA_PROC,
    PREPROCESSOR_CONFIG,
    vision_config,
    vision_tensor_specs,
)
from moe_export.graphs.weights import TensorSpec, all_tensor_specs
from moe_export.quantize.mxfp4 import decode, encode

# BPE merges of the synthetic tokenizer (ranks 256.. in this order; each is two earlier tokens).
SYNTHETIC_MERGES = (
    b"th", b"in", b"ink", b"think", b"er", b"an", b"on", b"re", b"es", b" t", b"ag", b"ss", b"me",
    b"mess", b"messag", b"message",
)


def synthetic_special_ids(family: str) -> dict[str, int]:
    """Name -> id of the synthetic tokenizer's named special tokens for `family` ("k3" | "k2")."""
    base = 256 + len(SYNTHETIC_MERGES)
    return {name: base + offset for offset, name in FAMILY_SPECIAL_NAMES[family].items()}


def synthetic_vocab_size() -> int:
    """Ids the synthetic tokenizer uses: byte ranks, merges, the reserved special range."""
    return 256 + len(SYNTHETIC_MERGES) + NUM_RESERVED_SPECIAL


def write_synthetic_tokenizer(out_dir: Path, family: str, model_max_length: int) -> None:
    """Write `tiktoken.model` and `tokenizer_config.json` (Kimi format) for the synthetic presets: byte ranks
    0..255 (any text round-trips), SYNTHETIC_MERGES, then the family's real special-token names."""
    ranks = [bytes([b]) for b in range(256)] + list(SYNTHETIC_MERGES)
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks)]
    atomic_write_bytes(out_dir / TIKTOKEN_FILE, "".join(lines).encode())
    ids = synthetic_special_ids(family)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
            for name, i in ids.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    atomic_write_json(out_dir / TOKENIZER_CONFIG, config)


TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
LAYERS_PER_SHARD = 3
VOCAB = -(-synthetic_vocab_size() // 64) * 64  # byte ranks + merges + 256 specials, rounded up
LICENSE_TEXT = (
    "Synthetic checkpoint written by `moe-export synth` (preset {preset}, seed {seed}).\n"
    "The weights are pseudo-random numbers, not trained parameters. They are dedicated to the public\n"
    "domain (CC0-1.0): use them for any purpose, without conditions.\n"
)


def _token_ids(family: str) -> dict[str, int]:
    """bos / eos / pad ids of the synthetic tokenizer; eos is the end-of-message token (the stop token)."""
    ids = synthetic_special_ids(family)
    return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids[END_OF_MESSAGE[family]], "pad_token_id": ids["[PAD]"]}


def tokenizer_family(cfg: ModelConfig) -> str:
    """The chat family of a synthetic checkpoint: K3's XTML tokens for kimi_k3, else K2's role tokens."""
    return "k3" if cfg.model_type == "kimi_k3" else "k2"


# The tiny tower: K3's layout (real names, 2-D RoPE, RMSNorm, 2x2 merge, patchmergerv2) at toy widths, with an
# 8x8 position table so most images resize it.
TINY_TOWER = {"init_pos_emb_height": 8, "init_pos_emb_width": 8, "vt_hidden_size": 32, "vt_num_hidden_layers": 2,
              "vt_num_attention_heads": 2, "qkv_hidden_size": 32, "vt_intermediate_size": 64, "mm_hidden_size": 32}


def _tiny_k3() -> dict[str, Any]:
    """K3's composite config at toy size: 7 layers (1-based MLA layers 4, 6, 7), 8 experts top-2."""
    from moe_export.recipes import models_dir

    cfg = json.loads((models_dir() / "kimi-k3.json").read_text())
    ids = _token_ids("k3")
    cfg.update(ids, media_placeholder_token_id=synthetic_special_ids("k3")[MEDIA_PAD])
    text = cfg["text_config"]
    text.update(
        ids,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        routed_expert_hidden_size=32,
        attn_res_block_size=3,
    )
    text["linear_attn_config"].update(num_heads=4, head_dim=16, full_attn_layers=[4, 6, 7], kda_layers=[1, 2, 3, 5])
    cfg["vision_config"].update(TINY_TOWER, text_hidden_size=text["hidden_size"])
    return cfg


def _tiny_k3_dsa() -> dict[str, Any]:
    """tiny-k3 plus a DSA lightning indexer (top-4 of the past tokens) on MLA layers 4 and 6 (1-based);
    the last MLA layer (7) is a GLM-5-Next style "shared" layer reusing layer 6's selection."""
    cfg = _tiny_k3()
    layers = cfg["text_config"]["num_hidden_layers"]
    cfg["text_config"].update(index_n_heads=2, index_head_dim=16, index_topk=4,
                              indexer_types=["full"] * (layers - 1) + ["shared"])
    return cfg


def _tiny_dsa_grouped() -> dict[str, Any]:
    """tiny-k3-dsa routed DeepSeek-V3.2 style: 16 experts in 4 groups, top-4 inside the best 2 groups
    (num_expert_group 4, topk_group 2), SwiGLU experts on the hidden width (no latent MoE)."""
    cfg = _tiny_k3_dsa()
    text = cfg["text_config"]
    for key in ("routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta", "activation_situ_linear_beta"):
        text.pop(key, None)
    text.update(hidden_act="silu", num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2)
    return cfg


def _tiny_kimi_linear() -> dict[str, Any]:
    """Kimi-Linear-48B-A3B's config at toy size (loads in transformers' KimiLinearForCausalLM)."""
    from moe_export.recipes import models_dir

    cfg = json.loads((models_dir() / "kimi-linear-48b-a3b.json").read_text())
    cfg.update(
        _token_ids("k2"),
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
    )
    cfg["linear_attn_config"].update(num_heads=4, head_dim=16, full_attn_layers=[4, 6], kda_layers=[1, 2, 3, 5])
    return cfg


def _mid_k3() -> dict[str, Any]:
    """K3 at its real widths (hidden 7168, 96 KDA and MLA heads, 576-wide MLA latent, expert latent 3584 and
    intermediate 3072, dense intermediate 33792, vocab 163,840, its vision tower) with 3 layers (KDA + dense, KDA +
    MoE, MLA + MoE) and 16 experts top-4: about 10 GB in bf16 / MXFP4, one GPU's worth of real shapes."""
    from moe_export.recipes import models_dir

    cfg = json.loads((models_dir() / "kimi-k3.json").read_text())
    ids = _token_ids("k3")
    cfg.update(ids, media_placeholder_token_id=synthetic_special_ids("k3")[MEDIA_PAD])
    text = cfg["text_config"]
    text.update(ids, num_hidden_layers=3, num_experts=16, num_experts_per_token=4)
    text["linear_attn_config"].update(full_attn_layers=[3], kda_layers=[1, 2])
    return cfg


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny-k3": _tiny_k3,
    "tiny-k3-dsa": _tiny_k3_dsa,
    "tiny-kimi-linear": _tiny_kimi_linear,
    "tiny-dsa-grouped": _tiny_dsa_grouped,
    "mid-k3": _mid_k3,
}
LARGE_PRESETS = ("mid-k3",)  # real widths, about 10 GB: for GPU checks, not the CPU test suite's every-preset loops
SMALL_PRESETS = tuple(p for p in PRESETS if p not in LARGE_PRESETS)


def preset_hf_config(preset: str) -> dict[str, Any]:
    """The HF config.json dict of a preset; InputError naming the known presets if unknown."""
    if preset not in PRESETS:
        raise InputError(f"unknown synthetic preset {preset!r}; known presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[preset]())


def preset_config(preset: str) -> ModelConfig:
    """The parsed ModelConfig of a preset."""
    return ModelConfig.from_hf_dict(preset_hf_config(preset), source=f"synthetic preset {preset}")


def vision_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """K3's vision tower and projector tensors (real names and layout, `graphs.vision`); empty without one."""
    vc = vision_config(cfg)
    return vision_tensor_specs(vc) if vc is not None else []


def synthetic_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor a synthetic checkpoint of this config holds: the inventory plus `vision_specs`."""
    return all_tensor_specs(cfg) + vision_specs(cfg)


def shard_plan(cfg: ModelConfig, specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """Group tensors into shards like K3: LAYERS_PER_SHARD decoder layers per shard, then the global
    tensors, then the projector, then the vision tower. Within a shard, wider dtypes come first so
    every tensor's data stays aligned to its element size."""
    n_layer_shards = math.ceil(cfg.num_layers / LAYERS_PER_SHARD)

    def shard_of(s: TensorSpec) -> int:
        if s.layer is not None:
            return s.layer // LAYERS_PER_SHARD
        if s.name.startswith("mm_projector."):
            return n_layer_shards + 1
        if s.name.startswith("vision_tower."):
            return n_layer_shards + 2
        return n_layer_shards

    groups: dict[int, list[tuple[int, TensorSpec]]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(shard_of(s), []).append((i, s))
    return [
        [s for _, s in sorted(groups[k], key=lambda p: (-TORCH_DTYPES[p[1].dtype].itemsize, p[0]))]
        for k in sorted(groups)
    ]


def shard_file_name(cfg: ModelConfig, index: int, count: int) -> str:
    """K3 names its shards model-000NN-of-000096 (six digits after "of"); others use HF's five."""
    width = 6 if cfg.model_type == "kimi_k3" else 5
    return f"model-{index:05d}-of-{count:0{width}d}.safetensors"


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=gen)


def _mxfp4_expert(seed: int, logical_name: str, logical_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed expert weight [out, in] ~ N(0, 1/in), MXFP4-encoded: (packed [out, in/2], scales [out, in/32])."""
    gen = _generator(seed, logical_name)
    w = torch.randn(logical_shape, generator=gen) / math.sqrt(logical_shape[1])
    return encode(w)


def synth_tensor(cfg: ModelConfig, spec: TensorSpec, seed: int) -> torch.Tensor:
    """The synthetic value of one tensor, in its stored dtype and shape.

    BF16 routed experts are drawn on the MXFP4 grid (exactly representable in bf16), so the build's
    bf16 -> MXFP4 conversion is lossless and engine-vs-reference parity can be tested exactly; the
    conversion's error on real weights is reported per tensor in the build manifest instead."""
    name, shape = spec.name, spec.shape
    for suffix, part in ((".weight_packed", 0), (".weight_scale", 1)):
        if name.endswith(suffix):
            return _mxfp4_expert(seed, name[: -len(suffix)], spec.logical_shape)[part]
    gen = _generator(seed, name)
    if name.endswith(".A_log"):
        nh = cfg.kda_num_heads
        per_head = _uniform((nh,), 1.0, 16.0, gen).log()
        if cfg.model_type == "kimi_k3":  # [max(head_dim, heads)]: one value per head, zero padding after
            x = torch.zeros(shape)
            x[:nh] = per_head
        else:  # [1, 1, H, 1]
            x = per_head.reshape(shape)
    elif name.endswith(".dt_bias"):  # transformers' KDA init: softplus^-1 of dt ~ logU(1e-3, 1e-1)
        dt = _uniform(shape, math.log(1e-3), math.log(1e-1), gen).exp().clamp_min(1e-4)
        x = dt + torch.log(-torch.expm1(-dt))
    elif name.endswith("e_score_correction_bias"):
        x = 0.02 * torch.randn(shape, generator=gen)
    elif name.endswith(("norm.weight", "norm0.weight", "norm1.weight")):  # every RMSNorm / LayerNorm scale
        x = _uniform(shape, 0.9, 1.1, gen)
    elif name.endswith("norm.bias"):
        x = 0.05 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        x = torch.randn(shape, generator=gen)
    elif spec.weight_class == "routed_experts":  # bf16 experts (Kimi Linear): values on the MXFP4 grid
        x = decode(*_mxfp4_expert(seed, name[: -len(".weight")], shape))
    else:  # weights [out, in, ...]: fan-in scaled
        x = torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
    return x.to(TORCH_DTYPES[spec.dtype])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _write_shard(path: Path, cfg: ModelConfig, specs: list[TensorSpec], seed: int) -> None:
    """Stream one safetensors file: the header (offsets from the specs), then each tensor's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            data = _tensor_bytes(synth_tensor(cfg, s, seed))
            if len(data) != s.nbytes:
                raise AssertionError(f"{s.name}: generated {len(data)} bytes, spec says {s.nbytes}")
            f.write(data)


def _write_files(tmp: Path, preset: str, hf: dict[str, Any], cfg: ModelConfig, seed: int) -> None:
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shards = shard_plan(cfg, synthetic_specs(cfg))
    weight_map: dict[str, str] = {}
    total = 0
    for i, specs in enumerate(shards, start=1):
        fname = shard_file_name(cfg, i, len(shards))
        _write_shard(tmp / fname, cfg, specs, seed)
        for s in specs:
            weight_map[s.name] = fname
            total += s.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_synthetic_tokenizer(tmp, tokenizer_family(cfg), cfg.max_position_embeddings)
    if vision_config(cfg) is not None:  # K3's image processor settings, as the checkpoint ships them
        (tmp / PREPROCESSOR_CONFIG).write_text(json.dumps({"media_proc_cfg": K3_MEDIA_PROC}, indent=2, sort_keys=True) + "\n")
    (tmp / "LICENSE").write_text(LICENSE_TEXT.format(preset=preset, seed=seed))


def write_synthetic_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, force: bool = False,
                               vision: dict[str, Any] | None = None) -> Path:
    """Write preset `preset` with `seed` to `out_dir` (atomically) and return its path; `vision` replaces keys of
    the preset's vision_config (a K3 preset with a larger tower, as `benchmarks/vision.py` uses).

    An existing non-empty `out_dir` is an InputError unless `force`, which replaces it.
    """
    hf = preset_hf_config(preset)
    if vision:
        if "vision_config" not in hf:
            raise InputError(f"synthetic preset {preset} has no vision tower to resize")
        hf["vision_config"].update(vision)
    cfg = ModelConfig.from_hf_dict(hf, source=f"synthetic preset {preset}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"{out}: directory is not empty (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.synth-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, preset, hf, cfg, seed)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

"""The reference model's weights: one dataclass per block (MLP, KDA, DSA indexer, MLA, MoE, attention residuals,
layer, model) and the loaders that read them from a checkpoint by their on-disk names, MXFP4 experts decoded.
Tensors are stored in the loader's `dtype`; fp32 checkpoint tensors (A_log, dt_bias, conv weights, router bias)
stay fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import layer_prefix, lm_head_name, model_prefix
from moe_export.quantize import mxfp4


class WeightSource(Protocol):
    """What the loaders need from a checkpoint: the parsed config and tensors by on-disk name."""

    config: ModelConfig

    def get(self, name: str) -> torch.Tensor: ...


# ----------------------------------------------------------------------------------------------
# Weights (all `[out, in]` like nn.Linear; compute dtype unless noted fp32)
# ----------------------------------------------------------------------------------------------


@dataclass
class MLPWeights:
    """Gated MLP: down(act(gate x) * up x). gate/up [I, D_in], down [D_in, I]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class KDAWeights:
    q_proj: torch.Tensor  # [P, D], P = kda_num_heads * kda_head_dim
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    q_conv: torch.Tensor  # [P, K] fp32, taps oldest -> newest
    k_conv: torch.Tensor
    v_conv: torch.Tensor
    f_a: torch.Tensor  # [Dh, D]
    f_b: torch.Tensor  # [P, Dh]
    b_proj: torch.Tensor  # [H, D]
    g_proj: torch.Tensor | None  # [P, D] full-rank output gate, or
    g_a: torch.Tensor | None  # [Dh, D] + g_b [P, Dh] low-rank output gate
    g_b: torch.Tensor | None
    A_log: torch.Tensor  # [H] fp32, one per head
    dt_bias: torch.Tensor  # [P] fp32
    o_norm: torch.Tensor  # [Dh] fp32, shared by all heads
    o_proj: torch.Tensor  # [D, P]


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor  # [Hi * Di, q_lora_rank]
    wk: torch.Tensor  # [Di, D]
    k_norm_weight: torch.Tensor  # [Di]
    k_norm_bias: torch.Tensor  # [Di]
    weights_proj: torch.Tensor  # [Hi, D]


@dataclass
class MLAWeights:
    q_a: torch.Tensor | None  # [q_lora, D]   (q-LoRA), or
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor | None  # [H * qk, q_lora]
    q_proj: torch.Tensor | None  # [H * qk, D] (plain q projection)
    kv_a: torch.Tensor  # [kv_lora + rope, D]
    kv_a_norm: torch.Tensor  # [kv_lora]
    kv_b: torch.Tensor  # [H * (nope + v), kv_lora], per head [k_nope | v]
    g_proj: torch.Tensor | None  # [H * v, D] sigmoid output gate
    o_proj: torch.Tensor  # [D, H * v]
    indexer: IndexerWeights | None


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, D] fp32
    router_bias: torch.Tensor  # [E] fp32 e_score_correction_bias (selection only)
    latent_down: torch.Tensor | None  # [L, D] latent MoE (K3), else None
    latent_norm: torch.Tensor | None  # [L]
    latent_up: torch.Tensor | None  # [D, L]
    shared: MLPWeights | None  # on the full hidden
    experts: dict[int, MLPWeights]  # expert id -> weights on the expert width (L or D)


@dataclass
class AttnResWeights:
    norm: torch.Tensor  # [D] (RMSNorm weight used inside the key)
    proj: torch.Tensor  # [D] (row 0 of the [1, D] projection)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    attn: KDAWeights | MLAWeights
    ffn: MLPWeights | MoEWeights
    attn_res: AttnResWeights | None  # before attention
    mlp_res: AttnResWeights | None  # before the FFN


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]
    output_res: AttnResWeights | None
    layers: list[LayerWeights]


# ----------------------------------------------------------------------------------------------
# Loading from a checkpoint reader
# ----------------------------------------------------------------------------------------------


def _loader(src: WeightSource, dtype: torch.dtype):
    """Returns get(name, keep_fp32=False): tensors cast to `dtype`, or to fp32 where the spec keeps fp32."""

    def get(name: str, keep_fp32: bool = False) -> torch.Tensor:
        return src.get(name).to(torch.float32 if keep_fp32 else dtype)

    return get


def load_mlp(src: WeightSource, prefix: str, dtype: torch.dtype) -> MLPWeights:
    get = _loader(src, dtype)
    return MLPWeights(get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight"), get(prefix + "down_proj.weight"))


def load_expert(src: WeightSource, layer: int, expert: int, dtype: torch.dtype) -> MLPWeights:
    """Routed expert `expert` of `layer`: w1 = gate, w3 = up, w2 = down; MXFP4 experts are decoded."""
    cfg = src.config
    pre = f"{layer_prefix(cfg, layer)}block_sparse_moe.experts.{expert}."

    def one(w: str) -> torch.Tensor:
        if cfg.experts_mxfp4:
            packed, scales = src.get(pre + w + ".weight_packed"), src.get(pre + w + ".weight_scale")
            return mxfp4.decode(packed, scales, dtype=torch.float32).to(dtype)
        return src.get(pre + w + ".weight").to(dtype)

    return MLPWeights(gate=one("w1"), up=one("w3"), down=one("w2"))


def load_kda(src: WeightSource, layer: int, dtype: torch.dtype) -> KDAWeights:
    cfg = src.config
    pre = layer_prefix(cfg, layer) + "self_attn."
    get = _loader(src, dtype)
    a_log = get(pre + "A_log", True).reshape(-1)
    heads = cfg.kda_num_heads
    if a_log.numel() < heads or bool(a_log[heads:].any()):
        raise InputError(
            f"{pre}A_log: expected one value per KDA head ({heads}) followed by zero padding, "
            f"got {a_log.numel()} values with a nonzero tail"
        )
    full_gate = cfg.use_full_rank_gate
    return KDAWeights(
        q_proj=get(pre + "q_proj.weight"),
        k_proj=get(pre + "k_proj.weight"),
        v_proj=get(pre + "v_proj.weight"),
        q_conv=get(pre + "q_conv1d.weight", True).squeeze(1),
        k_conv=get(pre + "k_conv1d.weight", True).squeeze(1),
        v_conv=get(pre + "v_conv1d.weight", True).squeeze(1),
        f_a=get(pre + "f_a_proj.weight"),
        f_b=get(pre + "f_b_proj.weight"),
        b_proj=get(pre + "b_proj.weight"),
        g_proj=get(pre + "g_proj.weight") if full_gate else None,
        g_a=None if full_gate else get(pre + "g_a_proj.weight"),
        g_b=None if full_gate else get(pre + "g_b_proj.weight"),
        A_log=a_log[:heads],
        dt_bias=get(pre + "dt_bias", True),
        o_norm=get(pre + "o_norm.weight", True),
        o_proj=get(pre + "o_proj.weight"),
    )


def load_mla(src: WeightSource, layer: int, dtype: torch.dtype) -> MLAWeights:
    cfg = src.config
    pre = layer_prefix(cfg, layer) + "self_attn."
    get = _loader(src, dtype)
    lora = cfg.q_lora_rank is not None
    indexer = None
    if cfg.has_indexer(layer):
        ip = pre + "indexer."
        indexer = IndexerWeights(
            wq_b=get(ip + "wq_b.weight"),
            wk=get(ip + "wk.weight"),
            k_norm_weight=get(ip + "k_norm.weight"),
            k_norm_bias=get(ip + "k_norm.bias"),
            weights_proj=get(ip + "weights_proj.weight"),
        )
    return MLAWeights(
        q_a=get(pre + "q_a_proj.weight") if lora else None,
        q_a_norm=get(pre + "q_a_layernorm.weight") if lora else None,
        q_b=get(pre + "q_b_proj.weight") if lora else None,
        q_proj=None if lora else get(pre + "q_proj.weight"),
        kv_a=get(pre + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=get(pre + "kv_a_layernorm.weight"),
        kv_b=get(pre + "kv_b_proj.weight"),
        g_proj=get(pre + "g_proj.weight") if cfg.mla_use_output_gate else None,
        o_proj=get(pre + "o_proj.weight"),
        indexer=indexer,
    )


def load_moe(src: WeightSource, layer: int, dtype: torch.dtype, experts: list[int] | None = None) -> MoEWeights:
    """The MoE block of `layer`; `experts` restricts which routed experts are loaded (default: all)."""
    cfg = src.config
    pre = layer_prefix(cfg, layer) + "block_sparse_moe."
    get = _loader(src, dtype)
    latent = cfg.routed_expert_hidden_size is not None
    ids = range(cfg.num_experts) if experts is None else experts
    return MoEWeights(
        router=get(pre + "gate.weight", True),
        router_bias=get(pre + "gate.e_score_correction_bias", True),
        latent_down=get(pre + "routed_expert_down_proj.weight") if latent else None,
        latent_norm=get(pre + "routed_expert_norm.weight") if latent and cfg.latent_moe_use_norm else None,
        latent_up=get(pre + "routed_expert_up_proj.weight") if latent else None,
        shared=load_mlp(src, pre + "shared_experts.", dtype) if cfg.num_shared_experts else None,
        experts={e: load_expert(src, layer, e, dtype) for e in ids},
    )


def _load_attn_res(src: WeightSource, prefix: str, dtype: torch.dtype) -> AttnResWeights:
    get = _loader(src, dtype)
    return AttnResWeights(norm=get(prefix + "_norm.weight"), proj=get(prefix + "_proj.weight").reshape(-1))


def load_layer(src: WeightSource, layer: int, dtype: torch.dtype) -> LayerWeights:
    cfg = src.config
    pre = layer_prefix(cfg, layer)
    get = _loader(src, dtype)
    res = cfg.attn_res_block_size is not None
    return LayerWeights(
        input_norm=get(pre + "input_layernorm.weight"),
        post_norm=get(pre + "post_attention_layernorm.weight"),
        attn=load_kda(src, layer, dtype) if cfg.is_kda(layer) else load_mla(src, layer, dtype),
        ffn=load_moe(src, layer, dtype) if cfg.is_moe(layer) else load_mlp(src, pre + "mlp.", dtype),
        attn_res=_load_attn_res(src, pre + "self_attention_res", dtype) if res else None,
        mlp_res=_load_attn_res(src, pre + "mlp_res", dtype) if res else None,
    )


def load_weights(src: WeightSource, dtype: torch.dtype = torch.float32) -> ModelWeights:
    """Every language-model weight of the checkpoint, experts decoded, in `dtype` (fp32 tensors kept fp32)."""
    cfg = src.config
    get = _loader(src, dtype)
    pre = model_prefix(cfg)
    embed = get(pre + "embed_tokens.weight")
    return ModelWeights(
        embed=embed,
        norm=get(pre + "norm.weight"),
        lm_head=embed if cfg.tie_word_embeddings else get(lm_head_name(cfg)),
        output_res=_load_attn_res(src, pre + "output_attn_res", dtype) if cfg.attn_res_block_size else None,
        layers=[load_layer(src, i, dtype) for i in range(cfg.num_layers)],
    )

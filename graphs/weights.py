"""The checkpoint's tensor inventory: every name, shape, dtype and weight class a config implies.

This is the single source of truth used by the checkpoint validator, the synthetic checkpoint
writer, the planner's byte counts and the converter. Names are the on-disk HF names, including the
``language_model.`` prefix of K3 composite checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_export.common.model_config import ModelConfig

# Weight classes, in census order.
WEIGHT_CLASSES = (
    "embeddings",
    "lm_head",
    "norms",
    "attn_res",
    "kda",
    "mla",
    "indexer",
    "dense",
    "router",
    "latent_proj",
    "shared_experts",
    "routed_experts",
    "vision",
)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor. dtype is the safetensors dtype string (BF16, F32, U8)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    weight_class: str
    layer: int | None = None  # decoder layer index, None for global tensors
    expert: int | None = None  # routed expert index
    logical_shape: tuple[int, ...] | None = None  # unpacked [out, in] shape for MXFP4 tensors

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8}


def model_prefix(cfg: ModelConfig) -> str:
    return cfg.weight_prefix + "model."


def lm_head_name(cfg: ModelConfig) -> str:
    return cfg.weight_prefix + "lm_head.weight"


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"{model_prefix(cfg)}layers.{layer}."


def expert_tensor_specs(cfg: ModelConfig, layer: int, expert: int) -> list[TensorSpec]:
    """The routed expert's tensors: MXFP4 packed + E8M0 scales, or BF16 [out, in] weights."""
    pre = f"{layer_prefix(cfg, layer)}block_sparse_moe.experts.{expert}."
    d, i = cfg.expert_in_dim, cfg.moe_intermediate_size
    out: list[TensorSpec] = []
    for w, (rows, cols) in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
        if cfg.experts_mxfp4:
            out.append(TensorSpec(f"{pre}{w}.weight_packed", (rows, cols // 2), "U8", "routed_experts", layer, expert, (rows, cols)))
            out.append(TensorSpec(f"{pre}{w}.weight_scale", (rows, cols // 32), "U8", "routed_experts", layer, expert, (rows, cols)))
        else:
            out.append(TensorSpec(f"{pre}{w}.weight", (rows, cols), "BF16", "routed_experts", layer, expert))
    return out


def layer_tensor_specs(cfg: ModelConfig, layer: int, include_experts: bool = True) -> list[TensorSpec]:
    """All tensors of decoder layer `layer` (0-based)."""
    pre = layer_prefix(cfg, layer)
    h = cfg.hidden_size
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], cls: str, dtype: str = "BF16") -> None:  # dtype: safetensors dtype
        specs.append(TensorSpec(pre + name, shape, dtype, cls, layer))

    add("input_layernorm.weight", (h,), "norms")
    add("post_attention_layernorm.weight", (h,), "norms")
    if cfg.attn_res_block_size is not None:
        for which in ("self_attention", "mlp"):
            add(f"{which}_res_norm.weight", (h,), "attn_res")
            add(f"{which}_res_proj.weight", (1, h), "attn_res")

    (_kda_specs if cfg.is_kda(layer) else _mla_specs)(cfg, layer, add)
    _ffn_specs(cfg, layer, add)
    if cfg.is_moe(layer) and include_experts:
        for e in range(cfg.num_experts):
            specs.extend(expert_tensor_specs(cfg, layer, e))
    return specs


_AddSpec = Callable[..., None]  # add(name inside the layer, shape, weight class[, dtype])


def _kda_specs(cfg: ModelConfig, layer: int, add: _AddSpec) -> None:
    """A KDA layer's attention tensors."""
    h, a = cfg.hidden_size, "self_attn."
    p, hd, nh = cfg.kda_proj_dim, cfg.kda_head_dim, cfg.kda_num_heads
    for x in "qkv":
        add(f"{a}{x}_proj.weight", (p, h), "kda")
    for x in "qkv":
        add(f"{a}{x}_conv1d.weight", (p, 1, cfg.conv_kernel_size), "kda", "F32")
    add(f"{a}f_a_proj.weight", (hd, h), "kda")
    add(f"{a}f_b_proj.weight", (p, hd), "kda")
    add(f"{a}b_proj.weight", (nh, h), "kda")
    if cfg.use_full_rank_gate:
        add(f"{a}g_proj.weight", (p, h), "kda")
    else:
        add(f"{a}g_a_proj.weight", (hd, h), "kda")
        add(f"{a}g_b_proj.weight", (p, hd), "kda")
    # K3 stores A_log as [head_dim] fp32 with the first num_heads entries meaningful (tail zero);
    # Kimi Linear stores [1, 1, H, 1].
    a_log_shape = (max(hd, nh),) if cfg.model_type == "kimi_k3" else (1, 1, nh, 1)
    add(f"{a}A_log", a_log_shape, "kda", "F32")
    add(f"{a}dt_bias", (p,), "kda", "F32")
    add(f"{a}o_norm.weight", (hd,), "kda", "F32")
    add(f"{a}o_proj.weight", (h, p), "kda")


def _mla_specs(cfg: ModelConfig, layer: int, add: _AddSpec) -> None:
    """An MLA layer's attention tensors (and its DSA indexer's)."""
    h, a = cfg.hidden_size, "self_attn."
    nh, qk = cfg.num_heads, cfg.qk_head_dim
    if cfg.q_lora_rank:
        add(f"{a}q_a_proj.weight", (cfg.q_lora_rank, h), "mla")
        add(f"{a}q_a_layernorm.weight", (cfg.q_lora_rank,), "mla")
        add(f"{a}q_b_proj.weight", (nh * qk, cfg.q_lora_rank), "mla")
    else:
        add(f"{a}q_proj.weight", (nh * qk, h), "mla")
    add(f"{a}kv_a_proj_with_mqa.weight", (cfg.latent_cache_dim, h), "mla")
    add(f"{a}kv_a_layernorm.weight", (cfg.kv_lora_rank,), "mla")
    add(f"{a}kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "mla")
    if cfg.mla_use_output_gate:
        add(f"{a}g_proj.weight", (nh * cfg.v_head_dim, h), "mla")
    add(f"{a}o_proj.weight", (h, nh * cfg.v_head_dim), "mla")
    if cfg.has_indexer(layer):
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        add(f"{a}indexer.wq_b.weight", (ih * idim, cfg.q_lora_rank), "indexer")
        add(f"{a}indexer.wk.weight", (idim, h), "indexer")
        add(f"{a}indexer.k_norm.weight", (idim,), "indexer")
        add(f"{a}indexer.k_norm.bias", (idim,), "indexer")
        add(f"{a}indexer.weights_proj.weight", (ih, h), "indexer")


def _ffn_specs(cfg: ModelConfig, layer: int, add: _AddSpec) -> None:
    """The layer's feed-forward tensors: the MoE block's router, latent projections and shared experts (routed
    experts: `expert_tensor_specs`), or the dense MLP."""
    h = cfg.hidden_size
    if cfg.is_moe(layer):
        m = "block_sparse_moe."
        add(f"{m}gate.weight", (cfg.num_experts, h), "router")
        add(f"{m}gate.e_score_correction_bias", (cfg.num_experts,), "router", "F32")
        if cfg.routed_expert_hidden_size:
            lat = cfg.routed_expert_hidden_size
            add(f"{m}routed_expert_down_proj.weight", (lat, h), "latent_proj")
            if cfg.latent_moe_use_norm:
                add(f"{m}routed_expert_norm.weight", (lat,), "latent_proj")
            add(f"{m}routed_expert_up_proj.weight", (h, lat), "latent_proj")
        if cfg.num_shared_experts:
            s = cfg.shared_intermediate_size
            add(f"{m}shared_experts.gate_proj.weight", (s, h), "shared_experts")
            add(f"{m}shared_experts.up_proj.weight", (s, h), "shared_experts")
            add(f"{m}shared_experts.down_proj.weight", (h, s), "shared_experts")
    else:
        add("mlp.gate_proj.weight", (cfg.intermediate_size, h), "dense")
        add("mlp.up_proj.weight", (cfg.intermediate_size, h), "dense")
        add("mlp.down_proj.weight", (h, cfg.intermediate_size), "dense")


def global_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Embedding, final norm, output attention-residual mix and lm_head."""
    pre = model_prefix(cfg)
    h = cfg.hidden_size
    specs = [
        TensorSpec(pre + "embed_tokens.weight", (cfg.vocab_size, h), "BF16", "embeddings"),
        TensorSpec(pre + "norm.weight", (h,), "BF16", "norms"),
    ]
    if cfg.attn_res_block_size is not None:
        specs.append(TensorSpec(pre + "output_attn_res_norm.weight", (h,), "BF16", "attn_res"))
        specs.append(TensorSpec(pre + "output_attn_res_proj.weight", (1, h), "BF16", "attn_res"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec(lm_head_name(cfg), (cfg.vocab_size, h), "BF16", "lm_head"))
    return specs


def all_tensor_specs(cfg: ModelConfig, include_experts: bool = True) -> list[TensorSpec]:
    """Every language-model tensor the config implies, globals first, then layer by layer."""
    specs = global_tensor_specs(cfg)
    for layer in range(cfg.num_layers):
        specs.extend(layer_tensor_specs(cfg, layer, include_experts))
    return specs


def classify_tensor_name(name: str) -> str:
    """Weight class of an arbitrary checkpoint tensor name (for the census of unknown tensors too)."""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return "vision"
    rules = (
        (".experts.", "routed_experts"),
        ("shared_experts.", "shared_experts"),
        ("routed_expert_", "latent_proj"),
        ("block_sparse_moe.gate.", "router"),
        ("self_attn.indexer.", "indexer"),
        ("_res_", "attn_res"),
        ("embed_tokens", "embeddings"),
        ("lm_head", "lm_head"),
        ("mlp.", "dense"),
    )
    for needle, cls in rules:
        if needle in name:
            return cls
    if "self_attn." in name:
        kda_markers = ("conv1d", "f_a_proj", "f_b_proj", "b_proj", "A_log", "dt_bias", "o_norm", "g_a_proj", "g_b_proj")
        if any(m in name for m in kda_markers) or any(f"self_attn.{x}_proj" in name for x in "kv"):
            return "kda"
        return "mla"
    return "norms"

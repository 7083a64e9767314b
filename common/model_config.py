"""Model configuration for the Kimi hybrid family, parsed from Hugging Face `config.json`.

Supported architectures (registered by `model_type`):
  - ``kimi_k3``: composite config whose ``text_config`` holds the language model (Kimi K3).
  - ``kimi_linear``: Kimi-Linear-48B-A3B (KDA + NoPE MLA + MoE, no latent MoE, no attention residuals).
A config of either kind that also carries ``index_n_heads`` / ``index_head_dim`` / ``index_topk`` is the
DSA variant: its MLA layers select the top-k past tokens with a lightning indexer.

Layer lists in HF configs are 1-based; everything in this module is 0-based.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_export.common.errors import InputError

SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ModelConfig:
    """The language model's hyper-parameters, normalized across the family. Shapes in elements."""

    model_type: str  # "kimi_k3" or "kimi_linear" (the top-level HF model_type)
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    # MLA (NoPE): q = [nope | rope] per head, cache = [kv_lora_rank | qk_rope_head_dim] per token.
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    use_full_rank_gate: bool
    gate_lower_bound: float | None  # None -> softplus gate (Kimi Linear)
    # FFN / MoE
    hidden_act: str  # "situ" or "silu"
    situ_beta: float | None
    situ_linear_beta: float | None
    intermediate_size: int  # dense layers
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_expert_hidden_size: int | None  # latent MoE width (K3); None -> experts act on hidden
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    # Attention residuals (K3): None -> plain residual stream
    attn_res_block_size: int | None
    # DSA lightning indexer: all None -> dense MLA
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    index_shared_layers: tuple[int, ...] = ()  # MLA layers reusing the previous full layer's selection
    # Checkpoint format
    experts_mxfp4: bool = False  # routed experts stored as compressed-tensors mxfp4-pack-quantized
    weight_prefix: str = ""  # "language_model." for K3 composite checkpoints
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the first of eos_token_ids
    eos_token_ids: tuple[int, ...] = ()  # every stop id of config.json (top level, text_config) and generation_config.json
    pad_token_id: int | None = None
    max_position_embeddings: int = 1048576
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        """P = kda_num_heads * kda_head_dim."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def latent_cache_dim(self) -> int:
        """Values cached per token per MLA layer: [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts read and write (latent width for K3, hidden for Kimi Linear)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def has_dsa(self) -> bool:
        return self.index_topk is not None

    @property
    def architecture(self) -> str:
        """Human name of the detected architecture."""
        base = {"kimi_k3": "Kimi K3", "kimi_linear": "Kimi Linear"}[self.model_type]
        return base + (" + DSA indexer" if self.has_dsa else "")

    def has_indexer(self, layer: int) -> bool:
        """True for MLA layers that run their own DSA indexer ("full"); "shared" layers reuse a selection."""
        return self.has_dsa and layer in self.mla_layers and layer not in self.index_shared_layers

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def snapshot_layers(self) -> tuple[int, ...]:
        """Layers that snapshot the residual prefix before attention (attention residuals only)."""
        if self.attn_res_block_size is None:
            return ()
        return tuple(range(0, self.num_layers, self.attn_res_block_size))

    # ---- parsing ----
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json",
                     generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Parse an HF config dict (and the checkpoint's generation_config.json dict, whose eos ids are
        stop ids too); raises InputError naming the offending field."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InputError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        prefix = ""
        text = cfg
        if model_type == "kimi_k3":
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise InputError(f"{source}: model_type 'kimi_k3' needs a 'text_config' object")
            prefix = "language_model."
            source = f"{source}: text_config"
        else:
            source = f"{source}:"
        return cls._from_text_config(model_type, text, prefix, source, cfg, generation_config)

    @classmethod
    def _from_text_config(
        cls, model_type: str, t: dict[str, Any], prefix: str, source: str, raw: dict[str, Any],
        generation_config: dict[str, Any] | None,
    ) -> ModelConfig:
        f = _TextFields(t, source)
        req, opt = f.req, f.opt
        num_layers = req("num_hidden_layers")
        lac = t.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise InputError(f"{source} missing 'linear_attn_config' (KDA layer lists and head sizes)")
        kda, mla = _layer_kinds(lac, num_layers, source)
        hidden = req("hidden_size")
        num_heads = req("num_attention_heads")
        kda_heads, kda_head_dim = _attention_heads(t, lac, num_heads, source)
        hidden_act, situ_beta, situ_linear_beta = _activation(f)
        num_experts, topk = _routing(t, source)
        latent = t.get("routed_expert_hidden_size")
        attn_res = t.get("attn_res_block_size")
        if attn_res is not None and (not isinstance(attn_res, int) or attn_res <= 0):
            raise InputError(f"{source} field 'attn_res_block_size' must be a positive integer, got {attn_res!r}")
        q_lora = t.get("q_lora_rank")
        index, shared = _dsa_indexer(t, q_lora, num_layers, mla, source)
        experts_mxfp4 = _experts_mxfp4(t.get("quantization_config") or raw.get("quantization_config"), source)
        eos_ids = stop_token_ids(source, raw.get("eos_token_id"), t.get("eos_token_id"),
                                 (generation_config or {}).get("eos_token_id"))

        conf = cls(
            model_type=model_type,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            rms_norm_eps=float(opt("rms_norm_eps", 1e-5)),
            num_heads=num_heads,
            q_lora_rank=q_lora,
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
            kda_layers=tuple(kda),
            mla_layers=tuple(mla),
            kda_num_heads=kda_heads,
            kda_head_dim=kda_head_dim,
            conv_kernel_size=lac.get("short_conv_kernel_size", 4),
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            gate_lower_bound=lac.get("gate_lower_bound"),
            hidden_act=hidden_act,
            situ_beta=situ_beta,
            situ_linear_beta=situ_linear_beta,
            intermediate_size=req("intermediate_size"),
            first_k_dense_replace=t.get("first_k_dense_replace", 1),
            moe_layer_freq=t.get("moe_layer_freq", 1) or 1,
            num_experts=num_experts,
            num_experts_per_token=topk,
            moe_intermediate_size=t.get("moe_intermediate_size", 0) or 0,
            num_shared_experts=t.get("num_shared_experts", t.get("n_shared_experts", 0)) or 0,
            routed_expert_hidden_size=latent,
            latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
            moe_renormalize=bool(t.get("moe_renormalize", t.get("norm_topk_prob", True))),
            num_expert_group=t.get("num_expert_group", t.get("n_group", 1)) or 1,
            topk_group=t.get("topk_group", 1) or 1,
            attn_res_block_size=attn_res,
            index_n_heads=index["index_n_heads"],
            index_head_dim=index["index_head_dim"],
            index_topk=index["index_topk"],
            index_shared_layers=shared,
            experts_mxfp4=experts_mxfp4,
            weight_prefix=prefix,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            bos_token_id=raw.get("bos_token_id", t.get("bos_token_id")),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id", t.get("pad_token_id")),
            max_position_embeddings=t.get("max_position_embeddings", t.get("model_max_length", 1048576)),
            raw=raw,
        )
        conf._check_divisibility(source)
        return conf

    def _check_divisibility(self, source: str) -> None:
        if self.num_experts and self.num_expert_group != 1 and self.num_experts % self.num_expert_group:
            raise InputError(
                f"{source} field 'num_expert_group' ({self.num_expert_group}) must divide num_experts "
                f"({self.num_experts})"
            )
        for name, dim in (
            ("hidden_size", self.hidden_size),
            ("kv_lora_rank", self.kv_lora_rank),
            ("intermediate_size", self.intermediate_size),
        ):
            if dim % 32 and (self.experts_mxfp4 or name != "intermediate_size"):
                raise InputError(f"{source} field '{name}' ({dim}) must be a multiple of 32 (MXFP4 block size)")
        if self.num_experts:
            for name, dim in (("moe_intermediate_size", self.moe_intermediate_size), ("expert width", self.expert_in_dim)):
                if dim <= 0 or dim % 32:
                    raise InputError(f"{source} field '{name}' ({dim}) must be a positive multiple of 32 (MXFP4 blocks)")
        if self.kda_layers and self.conv_kernel_size < 1:
            raise InputError(f"{source} field 'linear_attn_config.short_conv_kernel_size' must be >= 1")
        if self.kda_layers and self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise InputError(f"{source} field 'linear_attn_config.gate_lower_bound' must be negative")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint directory (or a config file path)."""
        p = Path(path)
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise InputError(f"{cfg_path}: no config.json found")
        return cls.from_hf_dict(read_json_object(cfg_path), source=str(cfg_path), generation_config=read_generation_config(cfg_path.parent))


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; InputError naming the file if it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def read_generation_config(folder: str | Path) -> dict[str, Any] | None:
    """`generation_config.json` of a checkpoint or engine folder (None if absent); InputError if unreadable."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return None
    return read_json_object(path)


def stop_token_ids(source: str, *values: Any) -> tuple[int, ...]:
    """Every eos id of `values` (each None, an int or a list of ints), first occurrence first."""
    out: list[int] = []
    for val in values:
        for tok in val if isinstance(val, list) else [] if val is None else [val]:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise InputError(f"{source} eos_token_id must be a token id or a list of them, got {val!r}")
            if tok not in out:
                out.append(tok)
    return tuple(out)


def _shared_indexer_layers(t: dict[str, Any], num_layers: int, mla: list[int], source: str) -> tuple[int, ...]:
    """0-based MLA layers whose DSA indexer mode is "shared" (GLM-5-Next style `indexer_types`, one entry per
    layer, "full" or "shared"; or `index_topk_pattern`, a string of F / S). Empty when neither is given."""
    types = t.get("indexer_types")
    key = "indexer_types"
    if types is None and t.get("index_topk_pattern") is not None:
        key, pattern = "index_topk_pattern", t["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        return ()
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
        raise InputError(f"{source} field '{key}' must give 'full' or 'shared' (F / S) for each of the {num_layers} layers")
    shared = tuple(i for i in mla if types[i] == "shared")
    if shared and shared[0] == mla[0]:
        raise InputError(
            f"{source} field '{key}': layer {mla[0] + 1} (1-based), the first MLA layer, cannot be 'shared' "
            "(there is no earlier full indexer layer to reuse)"
        )
    return shared


def shipped_model_config(name: str) -> ModelConfig:
    """Load one of the configs shipped in `recipes/models/` (e.g. 'kimi-k3', 'kimi-linear-48b-a3b')."""
    from moe_export.common.recipe import shipped_dir

    path = shipped_dir("models") / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in shipped_dir("models").glob("*.json"))
        raise InputError(f"unknown shipped model config {name!r}; known: {', '.join(known)}")
    return ModelConfig.from_pretrained(path)


class _TextFields:
    """Typed reads of an HF text config's fields; errors name the field and `source`."""

    def __init__(self, t: dict[str, Any], source: str) -> None:
        self.t, self.source = t, source

    def req(self, key: str, kind: type = int) -> Any:
        if key not in self.t:
            raise InputError(f"{self.source} missing required field '{key}'")
        val = self.t[key]
        if kind is int and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
            raise InputError(f"{self.source} field '{key}' must be a positive integer, got {val!r}")
        if kind is float and not isinstance(val, (int, float)):
            raise InputError(f"{self.source} field '{key}' must be a number, got {val!r}")
        return val

    def opt(self, key: str, default: Any) -> Any:
        val = self.t.get(key, default)
        return default if val is None and default is not None else val


def _layer_kinds(lac: dict[str, Any], num_layers: int, source: str) -> tuple[list[int], list[int]]:
    """(KDA layers, MLA layers), 0-based and sorted, from linear_attn_config's 1-based lists; each layer in exactly
    one of them."""
    layer_lists = {}
    for key in ("kda_layers", "full_attn_layers"):
        vals = lac.get(key)
        if not isinstance(vals, list) or not all(isinstance(v, int) for v in vals):
            raise InputError(f"{source} field 'linear_attn_config.{key}' must be a list of 1-based layer numbers")
        bad = [v for v in vals if not 1 <= v <= num_layers]
        if bad:
            raise InputError(
                f"{source} field 'linear_attn_config.{key}' has layers {bad} outside 1..{num_layers} "
                "(the lists are 1-based)"
            )
        layer_lists[key] = sorted(v - 1 for v in vals)
    kda, mla = layer_lists["kda_layers"], layer_lists["full_attn_layers"]
    both = sorted(set(kda) & set(mla))
    missing = sorted(set(range(num_layers)) - set(kda) - set(mla))
    if both or missing or len(set(kda)) != len(kda) or len(set(mla)) != len(mla):
        raise InputError(
            f"{source} fields 'linear_attn_config.kda_layers' and 'full_attn_layers' must cover each of the "
            f"{num_layers} layers exactly once; "
            + (f"in both (1-based): {[i + 1 for i in both]}; " if both else "")
            + (f"in neither (1-based): {[i + 1 for i in missing]}" if missing else "duplicates present")
        )
    return kda, mla


def _attention_heads(t: dict[str, Any], lac: dict[str, Any], num_heads: int, source: str) -> tuple[int, int]:
    """(KDA heads, KDA head dim); MLA has one KV head per query head (num_key_value_heads = num_attention_heads)."""
    kda_heads = lac.get("num_heads", num_heads)
    kda_head_dim = lac.get("head_dim", 128)
    for key, val in (("linear_attn_config.num_heads", kda_heads), ("linear_attn_config.head_dim", kda_head_dim)):
        if not isinstance(val, int) or val <= 0:
            raise InputError(f"{source} field '{key}' must be a positive integer, got {val!r}")
    kv_heads = t.get("num_key_value_heads", num_heads) or num_heads
    if kv_heads != num_heads:
        raise InputError(
            f"{source} field 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads ({num_heads}) for MLA"
        )
    return kda_heads, kda_head_dim


def _activation(f: _TextFields) -> tuple[str, float | None, float | None]:
    """(hidden_act, SiTU beta, SiTU linear beta): the MLP activation, "silu" or "situ" (which needs its beta)."""
    hidden_act = f.opt("hidden_act", "silu")
    if hidden_act not in ("situ", "silu"):
        raise InputError(f"{f.source} field 'hidden_act' must be 'situ' or 'silu', got {hidden_act!r}")
    situ_beta = f.t.get("activation_situ_beta")
    if hidden_act == "situ" and situ_beta is None:
        raise InputError(f"{f.source} hidden_act 'situ' needs field 'activation_situ_beta'")
    return hidden_act, situ_beta, f.t.get("activation_situ_linear_beta")


def _routing(t: dict[str, Any], source: str) -> tuple[int, int]:
    """(routed experts, experts per token), 0 and 0 for a dense model."""
    num_experts = t.get("num_experts", t.get("num_local_experts", 0)) or 0
    topk = t.get("num_experts_per_token", t.get("num_experts_per_tok", 0)) or 0
    if num_experts and not 0 < topk <= num_experts:
        raise InputError(f"{source} field 'num_experts_per_token' ({topk}) must be in 1..num_experts ({num_experts})")
    return num_experts, topk


def _dsa_indexer(t: dict[str, Any], q_lora: int | None, num_layers: int, mla: list[int],
                 source: str) -> tuple[dict[str, int | None], tuple]:  # fmt: skip
    """The DSA indexer's fields (index_n_heads, index_head_dim, index_topk; all None without one) and the layers
    that share another layer's top-k."""
    index = {k: t.get(k) for k in ("index_n_heads", "index_head_dim", "index_topk")}
    if any(v is not None for v in index.values()):
        for k, v in index.items():
            if not isinstance(v, int) or v <= 0:
                raise InputError(f"{source} DSA field '{k}' must be a positive integer, got {v!r}")
        if q_lora is None:
            raise InputError(f"{source} the DSA indexer reads the q-LoRA latent: field 'q_lora_rank' is required")
    shared = _shared_indexer_layers(t, num_layers, mla, source) if index["index_topk"] is not None else ()
    return index, shared


def _experts_mxfp4(qc: dict[str, Any] | None, source: str) -> bool:
    """Whether the routed experts are stored MXFP4-packed (compressed-tensors 'mxfp4-pack-quantized')."""
    if not qc:
        return False
    fmt = qc.get("format")
    if qc.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise InputError(
            f"{source} field 'quantization_config' is {qc.get('quant_method')!r}/{fmt!r}; "
            "only compressed-tensors 'mxfp4-pack-quantized' routed experts are supported"
        )
    return True

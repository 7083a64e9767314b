"""Reference PyTorch model of the Kimi hybrid family: Kimi K3, Kimi Linear and the DSA variant.

A readable, fp32-by-default oracle written from `kimi-k3-architecture.md` §3. Everything below the
weight loaders is a plain function of (weights, inputs, cache), so a tensor- or expert-parallel
version can call the same pieces on its shards:

    rms_norm / gated_rms_norm / gated_act / mlp            shared building blocks
    kda_layer  (short_conv, kda_gate, gated_delta_scan)     linear attention, §3.3
    mla_project -> [indexer_keys, indexer_select] -> mla_attend -> mla_output     NoPE MLA (+ DSA), §3.4
    route -> routed_experts (partial sums OK) -> moe_combine                      MoE, §3.5
    attn_res / decoder_layer                                attention residuals, §3.6

`KimiModel.forward(ids, cache)` runs a batch of equal-length sequences; with a `ModelCache` it
continues from the cached state, so prefill, chunked prefill and token-by-token decode agree.
Shapes: B batch, T new tokens, S tokens in the cache (old + new), D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.model_weights import (  # noqa: F401 - the model's weight types, importable from here too
    WeightSource,
    MLPWeights,
    KDAWeights,
    IndexerWeights,
    MLAWeights,
    MoEWeights,
    AttnResWeights,
    LayerWeights,
    ModelWeights,
    load_mlp,
    load_expert,
    load_kda,
    load_mla,
    load_moe,
    load_layer,
    load_weights,
)
from moe_export.plugins.gated_delta_scan.reference import gated_delta_scan

MLA_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built with KimiRMSNorm's default eps
INDEXER_KNORM_EPS = 1e-6  # DSA indexer k_norm is a LayerNorm with eps 1e-6

# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


@dataclass
class KDACache:
    """Per-sequence KDA state. Windows hold the last K-1 conv *inputs* (projections before the conv)."""

    q_window: torch.Tensor  # [B, K-1, P] compute dtype
    k_window: torch.Tensor
    v_window: torch.Tensor
    state: torch.Tensor  # [B, H, Dk, Dv] fp32, key-first (transpose for the V-first engine layout)


@dataclass
class MLACache:
    """Per-token MLA latent `[RMSNorm(c) | k_pe]` and, with DSA, the indexer keys."""

    latent: torch.Tensor  # [B, S, kv_lora_rank + qk_rope_head_dim] compute dtype
    index_keys: torch.Tensor | None  # [B, S, index_head_dim] (after k_norm), None without an own indexer
    selection: DSASelection | None = None  # shared by all MLA layers of a DSA model


@dataclass
class DSASelection:
    """The top-k selection of the latest full-indexer layer in this step, reused by "shared" layers."""

    allowed: torch.Tensor | None = None  # [B, T, S] bool


@dataclass
class ModelCache:
    layers: list[KDACache | MLACache]
    length: int = 0  # tokens already processed per sequence


def new_cache(cfg: ModelConfig, batch: int, dtype: torch.dtype = torch.float32) -> ModelCache:
    """An empty cache for `batch` sequences: zero conv windows / KDA states, zero-length MLA caches."""
    layers: list[KDACache | MLACache] = []
    selection = DSASelection() if cfg.has_dsa else None
    for i in range(cfg.num_layers):
        if cfg.is_kda(i):
            win = torch.zeros(batch, cfg.conv_kernel_size - 1, cfg.kda_proj_dim, dtype=dtype)
            state = torch.zeros(batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim, dtype=torch.float32)
            layers.append(KDACache(win.clone(), win.clone(), win.clone(), state))
        else:
            keys = torch.zeros(batch, 0, cfg.index_head_dim, dtype=dtype) if cfg.has_indexer(i) else None
            layers.append(MLACache(torch.zeros(batch, 0, cfg.latent_cache_dim, dtype=dtype), keys, selection))
    return ModelCache(layers)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm over the last dim: normalize in fp32, cast back to x.dtype, then multiply by weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA o_norm, all fp32: RMSNorm(x) * weight * sigmoid(gate) (norm, then weight, then gate)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y * torch.sigmoid(gate.float())


def gated_act(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """SiTU (K3) or SwiGLU (Kimi Linear) of the gate/up projections, in gate.dtype.

    SiTU: beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb), computed in fp32 (sigmoid of the uncapped g)."""
    if cfg.hidden_act == "silu":
        return F.silu(gate) * up
    g, u = gate.float(), up.float()
    beta, lb = cfg.situ_beta, cfg.situ_linear_beta
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if lb is not None:
        u = lb * torch.tanh(u / lb)
    return (a * u).to(gate.dtype)


def mlp(x: torch.Tensor, w: MLPWeights, cfg: ModelConfig) -> torch.Tensor:
    """Dense layer / shared experts / one routed expert: [..., D_in] -> [..., D_in]."""
    return F.linear(gated_act(F.linear(x, w.gate), F.linear(x, w.up), cfg), w.down)


# ----------------------------------------------------------------------------------------------
# KDA (§3.3)
# ----------------------------------------------------------------------------------------------


def short_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU with a carried window.

    x [B, T, C]; window [B, K-1, C] = the previous K-1 inputs (zeros at the start); weight [C, K] fp32.
    y_t[c] = silu(sum_j weight[c, j] * x_{t-K+1+j}[c]), computed in fp32. Returns (y in x.dtype, new window)."""
    k = weight.shape[-1]
    ext = torch.cat([window.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    taps = ext.float().unfold(1, k, 1)  # [B, T, C, K]
    y = F.silu((taps * weight.float()).sum(-1))
    return y.to(x.dtype), ext[:, ext.shape[1] - (k - 1) :]


def kda_gate(g_raw: torch.Tensor, w: KDAWeights, cfg: ModelConfig) -> torch.Tensor:
    """Log-space per-channel decay g [B, T, H, Dh] fp32 from the low-rank gate logits g_raw [B, T, P].

    Safe gate (K3): lower_bound * sigmoid(exp(A_log[h]) * u); softplus gate (Kimi Linear):
    -exp(A_log[h]) * softplus(u); u = g_raw + dt_bias. A is per head."""
    b, t, _ = g_raw.shape
    u = (g_raw.float() + w.dt_bias.float()).view(b, t, cfg.kda_num_heads, cfg.kda_head_dim)
    a = torch.exp(w.A_log.float()).view(1, 1, -1, 1)
    if cfg.gate_lower_bound is not None:
        return cfg.gate_lower_bound * torch.sigmoid(a * u)
    return -a * F.softplus(u, beta=1.0, threshold=20.0)


def kda_layer(x: torch.Tensor, w: KDAWeights, cfg: ModelConfig, cache: KDACache) -> torch.Tensor:
    """Kimi Delta Attention on normed input x [B, T, D] -> [B, T, D]; advances `cache` in place."""
    b, t, _ = x.shape
    shape = (b, t, cfg.kda_num_heads, cfg.kda_head_dim)
    q, cache.q_window = short_conv(F.linear(x, w.q_proj), cache.q_window, w.q_conv)
    k, cache.k_window = short_conv(F.linear(x, w.k_proj), cache.k_window, w.k_conv)
    v, cache.v_window = short_conv(F.linear(x, w.v_proj), cache.v_window, w.v_conv)
    g = kda_gate(F.linear(F.linear(x, w.f_a), w.f_b), w, cfg)
    beta = torch.sigmoid(F.linear(x, w.b_proj).float())  # [B, T, H]
    o, cache.state = gated_delta_scan(  # q, k L2-normed over Dh in fp32 (x / sqrt(sum x^2 + 1e-6))
        q.view(shape).float(),
        k.view(shape).float(),
        v.view(shape).float(),
        g,
        beta,
        scale=cfg.kda_head_dim**-0.5,
        initial_state=cache.state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    gate = F.linear(x, w.g_proj) if w.g_proj is not None else F.linear(F.linear(x, w.g_a), w.g_b)
    o = gated_rms_norm(o, gate.view(shape), w.o_norm, cfg.rms_norm_eps).to(x.dtype)
    return F.linear(o.reshape(b, t, -1), w.o_proj)


# ----------------------------------------------------------------------------------------------
# MLA, NoPE (§3.4) and the DSA lightning indexer
# ----------------------------------------------------------------------------------------------


def mla_project(
    x: torch.Tensor, w: MLAWeights, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Normed input x [B, T, D] -> (q [B, T, H, nope+rope], q-LoRA latent [B, T, q_lora] or None,
    cache latent [B, T, kv_lora + rope] = [RMSNorm_1e-6(c) | k_pe]). No rotation anywhere (NoPE)."""
    b, t, _ = x.shape
    q_latent = None
    if w.q_a is not None:
        q_latent = rms_norm(F.linear(x, w.q_a), w.q_a_norm, MLA_LATENT_NORM_EPS)
        q = F.linear(q_latent, w.q_b)
    else:
        q = F.linear(x, w.q_proj)
    c, k_pe = F.linear(x, w.kv_a).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent = torch.cat([rms_norm(c, w.kv_a_norm, MLA_LATENT_NORM_EPS), k_pe], dim=-1)
    return q.view(b, t, cfg.num_heads, cfg.qk_head_dim), q_latent, latent


def causal_mask(t: int, s: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, S] bool: query i (at absolute position s - t + i) may see keys 0 .. s - t + i."""
    return torch.arange(s, device=device)[None, :] <= torch.arange(s - t, s, device=device)[:, None]


def indexer_keys(x: torch.Tensor, w: IndexerWeights) -> torch.Tensor:
    """Indexer keys k = LayerNorm(wk x) [B, T, Di] (one key head shared by all indexer heads)."""
    k = F.linear(x, w.wk)
    return F.layer_norm(k, (k.shape[-1],), w.k_norm_weight, w.k_norm_bias, INDEXER_KNORM_EPS)


def indexer_select(
    x: torch.Tensor,
    q_latent: torch.Tensor,
    keys: torch.Tensor,
    w: IndexerWeights,
    cfg: ModelConfig,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """DSA top-k selection. x [B, T, D] normed input, q_latent [B, T, q_lora], keys [B, S, Di] (all cached),
    allowed [T, S] causal mask. score[t, s] = sum_h w[t, h] * Hi^-0.5 * relu(q[t, h] . k[s] * Di^-0.5);
    returns [B, T, S] bool: the index_topk best causal keys of each query (all of them if fewer)."""
    b, t, _ = x.shape
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = F.linear(q_latent, w.wq_b).view(b, t, hi, di).float()
    scores = F.relu(torch.einsum("bthd,bsd->bths", q, keys.float()) * di**-0.5)
    head_w = F.linear(x, w.weights_proj).float() * hi**-0.5  # [B, T, Hi]
    index = torch.einsum("bth,bths->bts", head_w, scores).masked_fill(~allowed, float("-inf"))
    # stable descending sort: exact ties (e.g. several all-zero relu scores) go to the earlier token,
    # so the selection does not depend on how many tokens are in the cache
    top = index.sort(dim=-1, descending=True, stable=True).indices[..., : cfg.index_topk]
    selected = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
    return selected & allowed


def mla_attend(q: torch.Tensor, latent: torch.Tensor, w: MLAWeights, cfg: ModelConfig, allowed: torch.Tensor) -> torch.Tensor:
    """Non-absorbed attention over the cached latents. q [B, T, H, nope+rope], latent [B, S, kv_lora+rope],
    allowed [T, S] or [B, T, S] bool. k = [kv_b(c)_nope | k_pe shared by heads], v = kv_b(c)_v,
    scale (nope+rope)^-0.5, softmax in fp32. Returns [B, T, H, v_head_dim]."""
    b, s, _ = latent.shape
    nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
    c, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    k_nope, v = F.linear(c, w.kv_b).view(b, s, cfg.num_heads, nope + vd).split([nope, vd], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, cfg.num_heads, -1)], dim=-1)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * cfg.qk_head_dim**-0.5
    if allowed.dim() == 3:
        allowed = allowed[:, None]
    probs = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def mla_output(attn: torch.Tensor, x: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """attn [B, T, H, v] -> o_proj(attn * sigmoid(g_proj x)) (gate only when the layer has one) [B, T, D]."""
    y = attn.reshape(*attn.shape[:2], -1)
    if w.g_proj is not None:
        y = y * torch.sigmoid(F.linear(x, w.g_proj))
    return F.linear(y, w.o_proj)


def mla_layer(x: torch.Tensor, w: MLAWeights, cfg: ModelConfig, cache: MLACache) -> torch.Tensor:
    """MLA (+ DSA when the layer has an indexer) on normed input x [B, T, D] -> [B, T, D]; appends to `cache`."""
    q, q_latent, latent = mla_project(x, w, cfg)
    cache.latent = torch.cat([cache.latent, latent], dim=1)
    allowed = causal_mask(x.shape[1], cache.latent.shape[1], x.device)
    if w.indexer is not None:
        cache.index_keys = torch.cat([cache.index_keys, indexer_keys(x, w.indexer)], dim=1)
        allowed = indexer_select(x, q_latent, cache.index_keys, w.indexer, cfg, allowed)
        if cache.selection is not None:
            cache.selection.allowed = allowed
    elif cache.selection is not None:  # a "shared" DSA layer: the previous full layer's top-k selection
        allowed = cache.selection.allowed
    return mla_output(mla_attend(q, cache.latent, w, cfg, allowed), x, w)


# ----------------------------------------------------------------------------------------------
# Router and MoE (§3.5)
# ----------------------------------------------------------------------------------------------


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sigmoid router on x [N, D]. The bias only picks experts; weights are the unbiased scores,
    renormalized (sum + 1e-20) and scaled. Returns (expert ids [N, k] int64, weights [N, k] fp32)."""
    scores = torch.sigmoid(x.float() @ router.float().T)  # [N, E]
    choice = scores + bias.float()
    if cfg.num_expert_group > 1:  # keep the topk_group groups with the best top-2 sums
        grouped = choice.view(x.shape[0], cfg.num_expert_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1, sorted=False).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    idx = choice.topk(cfg.num_experts_per_token, dim=-1, sorted=False).indices
    weights = scores.gather(-1, idx)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def routed_experts(
    z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: dict[int, MLPWeights], cfg: ModelConfig
) -> torch.Tensor:
    """sum_j weights[:, j] * Expert_{idx[:, j]}(z) with fp32 accumulation: z [N, W] -> [N, W] fp32.

    Only experts present in `experts` contribute, so an expert-parallel rank holding a subset gets
    its partial sum (reduce the partials before the latent norm)."""
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
    for e in idx.unique().tolist():
        if e not in experts:
            continue
        tok, slot = torch.where(idx == e)
        y = mlp(z[tok], experts[e], cfg).float() * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def moe_combine(routed: torch.Tensor, x: torch.Tensor, w: MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    """Full (reduced) routed sum [N, W] fp32 -> latent norm + up projection (K3) + shared experts on x [N, D]."""
    y = routed.to(x.dtype)
    if w.latent_up is not None:
        if w.latent_norm is not None:
            y = rms_norm(y, w.latent_norm, cfg.rms_norm_eps)  # on the aggregate, not per expert
        y = F.linear(y, w.latent_up)
    if w.shared is not None:
        y = y + mlp(x, w.shared, cfg)
    return y


def moe_layer(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    """MoE block on normed input x [B, T, D] -> [B, T, D]."""
    xs = x.reshape(-1, x.shape[-1])
    idx, weights = route(xs, w.router, w.router_bias, cfg)
    z = F.linear(xs, w.latent_down) if w.latent_down is not None else xs
    return moe_combine(routed_experts(z, idx, weights, w.experts, cfg), xs, w, cfg).view_as(x)


# ----------------------------------------------------------------------------------------------
# Attention residuals (§3.6) and the decoder layer
# ----------------------------------------------------------------------------------------------


def attn_res(prefix: torch.Tensor, snapshots: list[torch.Tensor], w: AttnResWeights, eps: float) -> torch.Tensor:
    """Softmax mix over depth of [*snapshots, prefix] (each [..., D]), in fp32.

    key_i = RMSNorm(v_i) (no weight), score_i = sum(key_i * norm.weight * proj), out = sum softmax(score)_i * v_i."""
    v = torch.stack([*snapshots, prefix], dim=-2).float()  # [..., S+1, D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    score = (k * (w.norm.float() * w.proj.float())).sum(-1)  # [..., S+1]
    return (torch.softmax(score, dim=-1).unsqueeze(-2) @ v).squeeze(-2).to(prefix.dtype)


def attention(x: torch.Tensor, w: KDAWeights | MLAWeights, cfg: ModelConfig, cache: KDACache | MLACache) -> torch.Tensor:
    if isinstance(w, KDAWeights):
        return kda_layer(x, w, cfg, cache)
    return mla_layer(x, w, cfg, cache)


def ffn(x: torch.Tensor, w: MLPWeights | MoEWeights, cfg: ModelConfig) -> torch.Tensor:
    return moe_layer(x, w, cfg) if isinstance(w, MoEWeights) else mlp(x, w, cfg)


def decoder_layer(
    i: int,
    h: torch.Tensor,
    snapshots: list[torch.Tensor],
    w: LayerWeights,
    cfg: ModelConfig,
    cache: KDACache | MLACache,
) -> torch.Tensor:
    """Decoder layer `i` on h [B, T, D]. Plain pre-norm residual, or with attention residuals: `h` is the
    running prefix P; layers with i % block == 0 append P to `snapshots` (in place) and restart P."""
    eps = cfg.rms_norm_eps
    if w.attn_res is None:
        h = h + attention(rms_norm(h, w.input_norm, eps), w.attn, cfg, cache)
        return h + ffn(rms_norm(h, w.post_norm, eps), w.ffn, cfg)
    prefix: torch.Tensor | None = h
    mixed = attn_res(h, snapshots, w.attn_res, eps) if snapshots else h
    if i % cfg.attn_res_block_size == 0:
        snapshots.append(h)
        prefix = None
    a = attention(rms_norm(mixed, w.input_norm, eps), w.attn, cfg, cache)
    prefix = a if prefix is None else prefix + a
    mixed = attn_res(prefix, snapshots, w.mlp_res, eps)
    return prefix + ffn(rms_norm(mixed, w.post_norm, eps), w.ffn, cfg)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


@dataclass
class KimiModel:
    """The whole language model. `forward(ids, cache)` -> logits; the cache is advanced in place."""

    cfg: ModelConfig
    weights: ModelWeights
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_source(cls, src: WeightSource, dtype: torch.dtype = torch.float32) -> KimiModel:
        """Build from a CheckpointReader-like object (`.config`, `.get(name)`)."""
        return cls(src.config, load_weights(src, dtype), dtype)

    def new_cache(self, batch: int = 1) -> ModelCache:
        return new_cache(self.cfg, batch, self.dtype)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: ModelCache | None = None, image_embeds: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] int64 -> logits [B, T, V] fp32. Without a cache, a fresh one is used (full forward).
        image_embeds [M, D] replace the input embeddings where image_mask [B, T] is set (K3's `<|media_pad|>`
        rows, row-major), as the public ports' masked scatter does."""
        if ids.dim() != 2:
            raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
        if cache is None:
            cache = self.new_cache(ids.shape[0])
        w = self.weights
        h = w.embed[ids]
        if image_embeds is not None:
            h = h.clone()
            h[image_mask] = image_embeds.to(h.dtype)
        snapshots: list[torch.Tensor] = []
        for i, layer in enumerate(w.layers):
            h = decoder_layer(i, h, snapshots, layer, self.cfg, cache.layers[i])
        if w.output_res is not None:
            h = attn_res(h, snapshots, w.output_res, self.cfg.rms_norm_eps)
        cache.length += ids.shape[1]
        return F.linear(rms_norm(h, w.norm, self.cfg.rms_norm_eps), w.lm_head).float()

    __call__ = forward
    prefill = forward

    def decode(self, ids: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """One step: ids [B] -> logits [B, V] fp32."""
        return self.forward(ids.view(-1, 1), cache)[:, 0]

"""K3's vision tower (MoonViT3d, K3 variant) and projector (PatchMergerMLPV2): config, tensor inventory, and
the fp32 PyTorch reference.

Written from `k3-vision.md` §1-2, each fact checked against the public ports it cites: SGLang
`models/kimi_k3_vl.py` (the "faithful port of the checkpoint reference implementation"), vLLM
`model_executor/models/kimi_k25_vit.py` (MoonViT3d blocks, `Rope2DPosEmbRepeated`, `tpool_patch_merger`).

    patch embed   Conv2d(3 -> D, kernel = stride = patch_size, no bias) on [L, 3, p, p] patches
    position      learned table [Hp, Wp, D] resized to each image's (h, w) grid with
                  F.interpolate(mode=pos_emb_interpolation_mode ("bilinear"), align_corners=False)
    block x N     x += wo(attn(rope2d(wqkv(rms0(x)))));  x += fc1(gelu_tanh(fc0(rms1(x))))
                  wqkv rows are [3, heads, head_dim]; 2-D RoPE: per head, complex pair k (dims 2k, 2k+1)
                  rotates by col * f_{k/2} for even k and row * f_{(k-1)/2} for odd k, f_j = theta^(-4j/hd)
                  (the [x_j, y_j] interleave of `Rope2DPosEmbRepeated`); attention is bidirectional and
                  per image (cu_seqlens), scale head_dim^-0.5
    final norm    RMSNorm
    merge         sd2_tpool: view(t, h/2, 2, w/2, 2, D), mean over t, tokens row-major, features (kh, kw, D)
    projector     Linear(4D -> 4D) -> exact GELU -> Linear(4D -> text hidden) -> RMSNorm(eps 1e-5), no biases

RMSNorm eps. The encoder norms are `nn.RMSNorm(dim)` without eps: current PyTorch uses float32's epsilon
(1.19e-7) whatever the input dtype; PyTorch before PR #142848 used the input dtype's (2^-7 for the bf16
checkpoint, the value a TensorRT-LLM comment gives). `VISION_NORM_EPS` names both; the recipe's
`vision.rms_norm_eps` picks one (default "float32", what current PyTorch computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import TensorSpec

# which dtype's machine epsilon the encoder's eps-less nn.RMSNorm uses (see the module docstring)
VISION_NORM_EPS = {"float32": float(torch.finfo(torch.float32).eps), "bfloat16": float(torch.finfo(torch.bfloat16).eps)}
ROPE_THETA = 10000.0
ROPE_MAX_GRID = 512  # Rope2DPosEmbRepeated(max_height=512, max_width=512)
TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# K3's image processor `media_proc_cfg` (k3-vision.md §3); a checkpoint's preprocessor_config.json overrides each
# key (`runtime.images.ImageProcessor`); the planner bounds an image's patches by its in_patch_limit.
K3_MEDIA_PROC = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "patch_limit_on_one_side": 512,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                              "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                              "chessboard_gray_value": 180},
    "transparent_bg_fill_stage": "after_resize",
}


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of a K3 checkpoint (only the K3 variant: RMSNorm, no biases, sd2_tpool, patchmergerv2)."""

    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int
    interpolation_mode: str
    hidden_size: int
    num_layers: int
    num_heads: int
    qkv_hidden_size: int
    intermediate_size: int
    merge_kernel: tuple[int, int]
    mm_hidden_size: int
    projector_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_dim(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1] * self.mm_hidden_size

    @property
    def merge_size(self) -> int:
        return self.merge_kernel[0]

    def params(self) -> int:
        return sum(s.numel for s in vision_tensor_specs(self))

    @classmethod
    def from_hf(cls, vc: dict[str, Any], text_hidden: int, source: str) -> VisionConfig:
        """Parse and check `vision_config`; InputError naming the field for anything this tower does not run."""
        where = f"{source}: vision_config"

        def num(key: str, default: Any = None) -> int:
            val = vc.get(key, default)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise InputError(f"{where} field '{key}' must be a positive integer, got {val!r}")
            return val

        expect = {"norm_type": "rmsnorm", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
                  "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "pos_emb_type": "divided_fixed",
                  "projector_hidden_act": "gelu"}
        for key, want in expect.items():
            if vc.get(key, want) != want:
                raise InputError(f"{where} field '{key}' is {vc.get(key)!r}; the K3 tower runs only {want!r}")
        for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if vc.get(key, False):
                raise InputError(f"{where} field '{key}' is true; the K3 tower has no biases")
        mode = vc.get("pos_emb_interpolation_mode", "bilinear")
        if mode not in ("bilinear",):
            raise InputError(f"{where} field 'pos_emb_interpolation_mode' is {mode!r}; supported: 'bilinear'")
        merge = vc.get("merge_kernel_size", [2, 2])
        if merge != [2, 2] and merge != (2, 2):
            raise InputError(f"{where} field 'merge_kernel_size' must be [2, 2], got {merge!r}")
        out = cls(
            patch_size=num("patch_size"),
            pos_emb_height=num("init_pos_emb_height"),
            pos_emb_width=num("init_pos_emb_width"),
            pos_emb_time=num("init_pos_emb_time", 4),
            interpolation_mode=mode,
            hidden_size=num("vt_hidden_size"),
            num_layers=num("vt_num_hidden_layers"),
            num_heads=num("vt_num_attention_heads"),
            qkv_hidden_size=num("qkv_hidden_size"),
            intermediate_size=num("vt_intermediate_size"),
            merge_kernel=(2, 2),
            mm_hidden_size=num("mm_hidden_size", vc.get("vt_hidden_size")),
            projector_eps=float(vc.get("projector_ln_eps", 1e-5)),
            text_hidden_size=num("text_hidden_size", text_hidden),
        )
        if out.qkv_hidden_size % out.num_heads or out.head_dim % 4:
            raise InputError(f"{where}: qkv_hidden_size / vt_num_attention_heads = head_dim must be a multiple of 4 "
                             f"(2-D RoPE), got {out.qkv_hidden_size} / {out.num_heads}")
        if out.mm_hidden_size != out.hidden_size:
            raise InputError(f"{where} field 'mm_hidden_size' ({out.mm_hidden_size}) must equal vt_hidden_size "
                             f"({out.hidden_size}): the projector reads the merged tower output")
        if out.text_hidden_size != text_hidden:
            raise InputError(f"{where} field 'text_hidden_size' ({out.text_hidden_size}) must equal the text "
                             f"model's hidden_size ({text_hidden})")
        return out


def vision_config(cfg: ModelConfig) -> VisionConfig | None:
    """The tower's config of a K3 checkpoint that ships `vision_config`; None for text-only configs."""
    vc = cfg.raw.get("vision_config") if cfg.model_type == "kimi_k3" else None
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise InputError("config.json: vision_config must be an object")
    return VisionConfig.from_hf(vc, cfg.hidden_size, "config.json")


def vision_tensor_specs(vc: VisionConfig) -> list[TensorSpec]:
    """Every tower and projector tensor (checkpoint names, bf16, weight class "vision"; never quantized)."""
    d, p, hd = vc.hidden_size, vc.patch_size, vc.qkv_hidden_size
    t = TOWER_PREFIX
    specs = [
        TensorSpec(t + "patch_embed.proj.weight", (d, 3, p, p), "BF16", "vision"),
        TensorSpec(t + "patch_embed.pos_emb.weight", (vc.pos_emb_height, vc.pos_emb_width, d), "BF16", "vision"),
    ]
    for i in range(vc.num_layers):
        b = f"{t}encoder.blocks.{i}."
        specs += [
            TensorSpec(b + "norm0.weight", (d,), "BF16", "vision"),
            TensorSpec(b + "wqkv.weight", (3 * hd, d), "BF16", "vision"),
            TensorSpec(b + "wo.weight", (d, hd), "BF16", "vision"),
            TensorSpec(b + "norm1.weight", (d,), "BF16", "vision"),
            TensorSpec(b + "mlp.fc0.weight", (vc.intermediate_size, d), "BF16", "vision"),
            TensorSpec(b + "mlp.fc1.weight", (d, vc.intermediate_size), "BF16", "vision"),
        ]
    m = vc.merged_dim
    specs += [
        TensorSpec(t + "encoder.final_layernorm.weight", (d,), "BF16", "vision"),
        TensorSpec(PROJECTOR_PREFIX + "proj.0.weight", (m, m), "BF16", "vision"),
        TensorSpec(PROJECTOR_PREFIX + "proj.2.weight", (vc.text_hidden_size, m), "BF16", "vision"),
        TensorSpec(PROJECTOR_PREFIX + "post_norm.weight", (vc.text_hidden_size,), "BF16", "vision"),
    ]
    return specs


def tower_activation_bytes(vc: VisionConfig, rows: int, act_bytes: int, scores_of: int = 0) -> int:
    """Peak activation bytes of one tower call over `rows` patches: the widest live row buffers (residual,
    qkv, MLP hidden, merged and projected rows) plus, when attention materializes its scores, one image of
    `scores_of` patches' scores over all heads."""
    per_row = 2 * vc.hidden_size + 3 * vc.qkv_hidden_size + vc.intermediate_size + vc.merged_dim // 4 * 2
    per_row += vc.text_hidden_size // 4
    return rows * per_row * act_bytes + vc.num_heads * scores_of * scores_of * act_bytes


# ------------------------------------------------------------------------------------------ geometry


def bilinear_taps(src: int, dst: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """F.interpolate(mode="bilinear", align_corners=False) along one axis as two taps per output index:
    (i0, i1, lam) with out[j] = (1 - lam[j]) * in[i0[j]] + lam[j] * in[i1[j]] (PyTorch's half-pixel source
    index, clamped at 0; scale = src / dst)."""
    scale = src / dst
    pos = ((torch.arange(dst, dtype=torch.float32) + 0.5) * scale - 0.5).clamp_min(0.0)
    i0 = pos.floor().long().clamp_max(src - 1)
    i1 = (i0 + 1).clamp_max(src - 1)
    return i0, i1, pos - i0.float()


def position_taps(vc: VisionConfig, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The resized position table of an (h, w) grid as 4 gathers from the flattened [Hp*Wp, D] table:
    indices [h*w, 4] int64 and weights [h*w, 4] fp32 (row-major over the grid). A grid equal to the table
    uses the table as is (one tap of weight 1), as the reference does."""
    hp, wp = vc.pos_emb_height, vc.pos_emb_width
    if (h, w) == (hp, wp):
        idx = torch.arange(h * w).unsqueeze(1).repeat(1, 4)
        wts = torch.zeros(h * w, 4)
        wts[:, 0] = 1.0
        return idx, wts
    r0, r1, ry = bilinear_taps(hp, h)
    c0, c1, cx = bilinear_taps(wp, w)
    rows = [(r0, 1 - ry), (r1, ry)]
    cols = [(c0, 1 - cx), (c1, cx)]
    idx, wts = [], []
    for ri, rw in rows:
        for ci, cw in cols:
            idx.append((ri[:, None] * wp + ci[None, :]).reshape(-1))
            wts.append((rw[:, None] * cw[None, :]).reshape(-1))
    return torch.stack(idx, 1), torch.stack(wts, 1)


def rope_angles(h: int, w: int, head_dim: int, t: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """[t*h*w, head_dim/2] fp32 rotation angle of each complex pair, made on `device` (default CPU): pair 2j turns by
    col * f_j, pair 2j+1 by row * f_j, f_j = theta^(-4j / head_dim) (Rope2DPosEmbRepeated's [x_j, y_j] interleave,
    column = x)."""
    if h > ROPE_MAX_GRID or w > ROPE_MAX_GRID:
        raise InputError(f"a {h}x{w} patch grid exceeds the 2-D RoPE table ({ROPE_MAX_GRID}x{ROPE_MAX_GRID})")
    f32 = dict(dtype=torch.float32, device=device)
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, **f32)[: head_dim // 4] / head_dim)
    ys, xs = torch.meshgrid(torch.arange(h, **f32), torch.arange(w, **f32), indexing="ij")
    ang = torch.stack([xs.reshape(-1, 1) * freqs, ys.reshape(-1, 1) * freqs], dim=-1).reshape(h * w, head_dim // 2)
    return ang.repeat(t, 1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, hd] with complex pairs (2k, 2k+1) rotated by angle k: cos / sin [L, hd/2] fp32; the rotation
    in fp32, the result in x's dtype (as the reference's complex product on `x.float()`, then `type_as(x)`)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """nn.RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, in fp32; the result in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def tpool_merge(x: torch.Tensor, t: int, h: int, w: int, kernel: tuple[int, int]) -> torch.Tensor:
    """sd2_tpool: [t*h*w, D] -> [(h/kh)(w/kw), kh*kw*D]; mean over t, tokens row-major, features (kh, kw, D)."""
    kh, kw = kernel
    d = x.shape[-1]
    x = x.view(t, h // kh, kh, w // kw, kw, d).permute(0, 1, 3, 2, 4, 5).mean(0)
    return x.reshape((h // kh) * (w // kw), kh * kw * d)


# ------------------------------------------------------------------------------------------ reference


@dataclass
class VisionTower:
    """The reference: `forward(pixel_values [L, 3, p, p], grid_thws [N, 3])` -> [sum of merged tokens, text hidden],
    images in order, each image's tokens row-major. Activations in the weights' dtype (fp32 for the reference,
    bf16 for the torch runner on a GPU), on their device; norms and rotations computed in fp32."""

    vc: VisionConfig
    weights: dict[str, torch.Tensor]
    norm_eps: float = VISION_NORM_EPS["float32"]

    @classmethod
    def from_source(cls, src, vc: VisionConfig, norm_eps: str = "float32") -> VisionTower:
        """Load every tower tensor from a checkpoint reader (`.get(name)`), as fp32."""
        return cls(vc, {s.name: src.get(s.name).float() for s in vision_tensor_specs(vc)}, VISION_NORM_EPS[norm_eps])

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' (fp32 for the reference, bf16 for the torch runner on a GPU)."""
        return self.w(PROJECTOR_PREFIX + "post_norm.weight").dtype

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def position(self, h: int, w: int) -> torch.Tensor:
        table = self.w(TOWER_PREFIX + "patch_embed.pos_emb.weight")
        if (h, w) == tuple(table.shape[:2]):
            return table.flatten(0, 1)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=self.vc.interpolation_mode,
                             align_corners=False)
        return grid[0].permute(1, 2, 0).flatten(0, 1)

    def block(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b = f"{TOWER_PREFIX}encoder.blocks.{i}."
        heads, hd = self.vc.num_heads, self.vc.head_dim
        qkv = F.linear(rms_norm(x, self.w(b + "norm0.weight"), self.norm_eps), self.w(b + "wqkv.weight"))
        q, k, v = qkv.view(-1, 3, heads, hd).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + F.linear(att.transpose(0, 1).reshape(-1, heads * hd), self.w(b + "wo.weight"))
        y = rms_norm(x, self.w(b + "norm1.weight"), self.norm_eps)
        y = F.gelu(F.linear(y, self.w(b + "mlp.fc0.weight")), approximate="tanh")
        return x + F.linear(y, self.w(b + "mlp.fc1.weight"))

    def encode_image(self, patches: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        """One image's patches [t*h*w, 3, p, p] -> merged tower features [(h/2)(w/2), 4 * D]."""
        if t != 1:
            raise InputError("Kimi K3 takes image input only (t = 1)")
        d = self.vc.hidden_size
        x = patches.reshape(patches.shape[0], -1) @ self.w(TOWER_PREFIX + "patch_embed.proj.weight").reshape(d, -1).T
        x = x + self.position(h, w)
        ang = rope_angles(h, w, self.vc.head_dim, device=x.device)
        cos, sin = ang.cos(), ang.sin()
        for i in range(self.vc.num_layers):
            x = self.block(i, x, cos, sin)
        x = rms_norm(x, self.w(TOWER_PREFIX + "encoder.final_layernorm.weight"), self.norm_eps)
        return tpool_merge(x, t, h, w, self.vc.merge_kernel)

    def project(self, merged: torch.Tensor) -> torch.Tensor:
        """PatchMergerMLPV2: [M, 4D] -> [M, text hidden]."""
        p = PROJECTOR_PREFIX
        y = F.gelu(F.linear(merged, self.w(p + "proj.0.weight")))
        y = F.linear(y, self.w(p + "proj.2.weight"))
        return rms_norm(y, self.w(p + "post_norm.weight"), self.vc.projector_eps)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for t, h, w in grid_thws.tolist():
            n = t * h * w
            out.append(self.project(self.encode_image(pixel_values[start:start + n].to(self.dtype), t, h, w)))
            start += n
        if start != pixel_values.shape[0]:
            raise InputError(f"grid_thws covers {start} patches, pixel_values has {pixel_values.shape[0]}")
        return torch.cat(out) if out else pixel_values.new_zeros(0, self.vc.text_hidden_size, dtype=self.dtype)

    __call__ = forward


def merged_tokens(grid_thws: torch.Tensor | list) -> list[int]:
    """Merged tokens (= `<|media_pad|>` rows) of each image: (h/2)(w/2)."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws
    return [(h // 2) * (w // 2) for _, h, w in rows]

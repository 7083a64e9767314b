"""One rank's decoder in PyTorch over its converted weights (`rank{N}/weights.safetensors`): the rank graph of
`graphs/onnx_export.py` (packed tokens, vocab-parallel embedding and head, tp-sharded attention and dense layers,
expert-parallel MXFP4 experts, the dp layout's token shares and all-to-all) written with the reference model's
pieces (`graphs/model.py`: rms_norm, mlp, kda_gate, gated_rms_norm, mla_project, mla_output, route, moe_combine,
attn_res, all on a config whose head counts are this rank's) and the plugins' kernels (`torch_kernels`).

`RankModel.step` is a generator yielding its collectives (`torch_collectives`). Compute dtype: the tensors' `act`
(fp32 on CPU, as the ONNX Runtime graphs compute; bf16 on GPUs); fp32 where the model needs it (router scores,
KDA gates and state, conv taps, norms' arithmetic, attention residual mixing, cache rows, logits); the router
is made fp32 once at load (routing computes in fp32), the routed experts take the activations as they are (bf16
into the W4A16 kernel on GPUs: tensor-core dots).
Shapes: T packed tokens, N sequences, D hidden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from moe_export.graphs import model as ref
from moe_export.common.model_config import ModelConfig
from moe_export.common.mapping import Mapping
from moe_export.common.errors import InputError
from moe_export.graphs.weights import layer_prefix, lm_head_name, model_prefix
from moe_export.plugins.moe_mxfp4 import layout as mxfp4_layout
from moe_export.quantize import fp8_cache
from moe_export.runtime.engine.torch_collectives import AllGather, AllReduce, Combine, DeviceLayout, Dispatch

FP8_BLOCK = 128
INDEXER_KNORM_EPS = 1e-6


@dataclass
class StepInputs:
    """A step batch as device tensors (see `batch.StepBatch`); image rows and embeddings may be None."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu: torch.Tensor  # [N+1] int64
    slots: torch.Tensor  # [N] int64
    tables: torch.Tensor  # [N, B] int64
    last: torch.Tensor  # [N] int64 rows whose logits are wanted
    image_rows: torch.Tensor | None = None  # [M] int64
    image_embeds: torch.Tensor | None = None  # [M, D] fp32


@dataclass
class RankKDA(ref.KDAWeights):
    qkv_conv: torch.Tensor  # [3P, W] fp32: q, k, v conv taps in the conv pool's channel order


@dataclass
class RankMLA(ref.MLAWeights):
    kv_b_heads: torch.Tensor  # [H, nope + v, kv_lora] per head [k_nope | v] rows (absorbed attention)


@dataclass
class RankMoE(ref.MoEWeights):
    shared_tp: ref.MLPWeights | None  # this rank's columns / rows of the shared experts (summed over tp)
    packed: tuple[torch.Tensor, ...]  # this rank's experts: w13_packed, w13_scale, w2_packed, w2_scale (MXFP4)


class RankWeights:
    """Tensors of one rank's weights file on `device`: floats in `act` (fp32 where stored fp32 or asked), FP8
    E4M3 weights dequantized with their 128x128 block scales, bytes (MXFP4) as stored, in the file's
    `mxfp4_layout` (`plugins/moe_mxfp4/layout.py`: standard, or the Triton kernel's for TensorRT builds)."""

    def __init__(self, path: Path, device: torch.device, act: torch.dtype) -> None:
        self.file = safe_open(str(path), framework="pt", device="cpu")
        self.names = set(self.file.keys())
        self.device, self.act = device, act
        self.mxfp4_layout = (self.file.metadata() or {}).get("mxfp4_layout", mxfp4_layout.STANDARD)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, fp32: bool = False) -> torch.Tensor:
        t = self.file.get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:
            scale = self.file.get_tensor(name + "_scale_inv").float()
            full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[: t.shape[0], : t.shape[1]]
            t = t.float() * full
        if t.is_floating_point():
            t = t.to(torch.float32 if fp32 or t.dtype == torch.float32 else self.act)
        return t.to(self.device)


class RankModel:
    """One rank's layers (see the module docstring) from `src` (`RankWeights`, or any source of the rank's tensors
    by name with the same `get` and `mxfp4_layout`). `topk`: the DSA indexer's top-k; `use_indexer`: False for a recipe with
    `attention.indexer: none` (MLA layers then attend densely); `cache_dtype`: the pools' storage."""

    def __init__(self, cfg: ModelConfig, mapping: Mapping, src: RankWeights, device: torch.device, act: torch.dtype,
                 *, use_indexer: bool, topk: int, cache_dtype: torch.dtype) -> None:
        self.cfg, self.m, self.device, self.act = cfg, mapping, device, act
        self.local = dataclasses.replace(cfg, num_heads=cfg.num_heads // mapping.tp,
                                         kda_num_heads=cfg.kda_num_heads // mapping.tp)
        self.use_indexer, self.topk, self.cache_dtype = use_indexer and cfg.has_dsa, topk, cache_dtype
        pre = model_prefix(cfg)
        self.embed = src.get(pre + "embed_tokens.weight")
        self.norm = src.get(pre + "norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else src.get(lm_head_name(cfg))
        self.output_res = self._attn_res(src, pre + "output_attn_res") if cfg.attn_res_block_size else None
        self.layers = [self._layer(src, i) for i in range(cfg.num_layers)]
        self.expert_layout = src.mxfp4_layout  # of the routed experts' packed bytes (`use_expert_layout`)
        self.moe_dim = cfg.routed_expert_hidden_size or cfg.hidden_size
        self.expert_attrs = dict(expert_offset=mapping.local_experts(cfg.num_experts).start if cfg.num_experts else 0,
                                 activation=cfg.hidden_act, situ_beta=float(cfg.situ_beta or 0.0),
                                 situ_linear_beta=float(cfg.situ_linear_beta or 0.0))

    def use_expert_layout(self, layout: str) -> None:
        """Put the routed experts' packed bytes in `layout`, the one the kernel table's `moe` reads: as they are
        when the file has it, else the standard bytes moved once into the Triton kernel's (`kernel_experts`,
        expert by expert in place: no second copy of the experts; InputError on a block scale above 2)."""
        if layout == self.expert_layout:
            return
        if (self.expert_layout, layout) != (mxfp4_layout.STANDARD, mxfp4_layout.KERNEL):
            raise InputError(f"rank {self.m.rank}: the weights' MXFP4 experts are in the {self.expert_layout!r} "
                             f"layout, the kernels read {layout!r} (run the engine on the backend it was built for)")
        for i, layer in enumerate(self.layers):
            if not self.cfg.is_moe(i):
                continue
            w13_packed, w13_scale, w2_packed, w2_scale = layer.ffn.packed
            for e in range(w13_packed.shape[0]):
                try:
                    w13_packed[e], _, w2_packed[e], _ = mxfp4_layout.kernel_experts(w13_packed[e], w13_scale[e],
                                                                                    w2_packed[e], w2_scale[e])
                except ValueError as err:
                    raise InputError(f"rank {self.m.rank} layer {i} expert "
                                     f"{self.expert_attrs['expert_offset'] + e}: {err}") from None
        self.expert_layout = layout

    # ---- weights ----
    def _attn_res(self, src: RankWeights, prefix: str) -> ref.AttnResWeights:
        return ref.AttnResWeights(norm=src.get(prefix + "_norm.weight", True),
                                  proj=src.get(prefix + "_proj.weight", True).reshape(-1))

    def _mlp(self, src: RankWeights, prefix: str) -> ref.MLPWeights:
        return ref.MLPWeights(*(src.get(f"{prefix}{w}_proj.weight") for w in ("gate", "up", "down")))

    def _layer(self, src: RankWeights, i: int) -> ref.LayerWeights:
        cfg, pre = self.cfg, layer_prefix(self.cfg, i)
        attn = self._kda(src, pre + "self_attn.") if cfg.is_kda(i) else self._mla(src, i, pre + "self_attn.")
        ffn = self._moe(src, pre + "block_sparse_moe.") if cfg.is_moe(i) else self._mlp(src, pre + "mlp.")
        res = cfg.attn_res_block_size is not None
        return ref.LayerWeights(input_norm=src.get(pre + "input_layernorm.weight"),
                                post_norm=src.get(pre + "post_attention_layernorm.weight"), attn=attn, ffn=ffn,
                                attn_res=self._attn_res(src, pre + "self_attention_res") if res else None,
                                mlp_res=self._attn_res(src, pre + "mlp_res") if res else None)

    def _kda(self, src: RankWeights, a: str) -> RankKDA:
        heads, h0 = self.local.kda_num_heads, self.m.tp_rank * self.local.kda_num_heads
        full = self.cfg.use_full_rank_gate
        conv = [src.get(f"{a}{c}_conv1d.weight", True).reshape(heads * self.cfg.kda_head_dim, -1) for c in "qkv"]
        return RankKDA(
            *(src.get(f"{a}{c}_proj.weight") for c in "qkv"), *conv,
            f_a=src.get(a + "f_a_proj.weight"), f_b=src.get(a + "f_b_proj.weight"), b_proj=src.get(a + "b_proj.weight"),
            g_proj=src.get(a + "g_proj.weight") if full else None, g_a=None if full else src.get(a + "g_a_proj.weight"),
            g_b=None if full else src.get(a + "g_b_proj.weight"),
            A_log=src.get(a + "A_log", True).reshape(-1)[h0:h0 + heads], dt_bias=src.get(a + "dt_bias", True),
            o_norm=src.get(a + "o_norm.weight", True), o_proj=src.get(a + "o_proj.weight"), qkv_conv=torch.cat(conv))

    def _mla(self, src: RankWeights, i: int, a: str) -> RankMLA:
        cfg, lora = self.cfg, self.cfg.q_lora_rank is not None
        nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
        indexer = None
        if self.use_indexer and cfg.has_indexer(i):
            ip = a + "indexer."
            indexer = ref.IndexerWeights(wq_b=src.get(ip + "wq_b.weight"), wk=src.get(ip + "wk.weight"),
                                         k_norm_weight=src.get(ip + "k_norm.weight", True),
                                         k_norm_bias=src.get(ip + "k_norm.bias", True),
                                         weights_proj=src.get(ip + "weights_proj.weight"))
        kv_b = src.get(a + "kv_b_proj.weight")
        return RankMLA(
            q_a=src.get(a + "q_a_proj.weight") if lora else None,
            q_a_norm=src.get(a + "q_a_layernorm.weight") if lora else None,
            q_b=src.get(a + "q_b_proj.weight") if lora else None,
            q_proj=None if lora else src.get(a + "q_proj.weight"),
            kv_a=src.get(a + "kv_a_proj_with_mqa.weight"), kv_a_norm=src.get(a + "kv_a_layernorm.weight"),
            kv_b=kv_b, g_proj=src.get(a + "g_proj.weight") if cfg.mla_use_output_gate else None,
            o_proj=src.get(a + "o_proj.weight"), indexer=indexer,
            kv_b_heads=kv_b.view(self.local.num_heads, nope + vd, cfg.kv_lora_rank))

    def _moe(self, src: RankWeights, p: str) -> RankMoE:
        cfg, latent = self.cfg, self.cfg.routed_expert_hidden_size is not None
        return RankMoE(
            router=src.get(p + "gate.weight", True), router_bias=src.get(p + "gate.e_score_correction_bias", True),
            latent_down=src.get(p + "routed_expert_down_proj.weight") if latent else None,
            latent_norm=src.get(p + "routed_expert_norm.weight") if latent and cfg.latent_moe_use_norm else None,
            latent_up=src.get(p + "routed_expert_up_proj.weight") if latent else None,
            shared=None, experts={},  # `moe_combine` adds no shared experts: `shared_tp` is summed over tp first
            shared_tp=self._mlp(src, p + "shared_experts.") if cfg.num_shared_experts else None,
            packed=tuple(src.get(f"{p}experts.{t}") for t in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")))

    # ---- helpers ----
    def to_storage(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 cache rows rounded to the pools' storage dtype (kept fp32)."""
        if self.cache_dtype == torch.float32:
            return rows
        if self.cache_dtype == torch.uint8:
            return fp8_cache.round_rows(rows)
        return rows.to(self.cache_dtype).float()

    def all_reduce(self, x: torch.Tensor, group: str):
        size = self.m.tp if group == "tp" else self.m.ep
        return x if size == 1 else (yield AllReduce(x, group))

    def mlp(self, x: torch.Tensor, w: ref.MLPWeights):
        return (yield from self.all_reduce(ref.mlp(x, w, self.cfg), "tp"))

    # ---- the decoder ----
    def step(self, inp: StepInputs, pools: dict[str, torch.Tensor], kernels):
        """One step of this rank: logits [N, vocab] fp32 (every rank of a tp group returns the same)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = yield from self.embed_tokens(inp.ids)
        if inp.image_rows is not None and inp.image_rows.numel():
            h = h.index_copy(0, inp.image_rows, inp.image_embeds.to(h.dtype))
        snaps: list[torch.Tensor] = []
        self.last_indices = None
        for i, w in enumerate(self.layers):
            attend = self.kda if cfg.is_kda(i) else self.mla
            if w.attn_res is None:
                h = h + (yield from attend(i, ref.rms_norm(h, w.input_norm, eps), w.attn, inp, pools, kernels))
                mixed = prefix = h
            else:
                mixed = ref.attn_res(h, snaps, w.attn_res, eps) if snaps else h
                prefix = h
                if i % cfg.attn_res_block_size == 0:
                    snaps.append(h)
                    prefix = None
                a = yield from attend(i, ref.rms_norm(mixed, w.input_norm, eps), w.attn, inp, pools, kernels)
                prefix = a if prefix is None else prefix + a
                mixed = ref.attn_res(prefix, snaps, w.mlp_res, eps)
            x = ref.rms_norm(mixed, w.post_norm, eps)
            f = yield from (self.moe(x, w.ffn, kernels) if cfg.is_moe(i) else self.mlp(x, w.ffn))
            h = prefix + f
        if self.output_res is not None:
            h = ref.attn_res(h[inp.last], [s[inp.last] for s in snaps], self.output_res, eps)
        else:
            h = h[inp.last]
        logits = F.linear(ref.rms_norm(h, self.norm, eps), self.lm_head).float()
        return logits if self.m.tp == 1 else (yield AllGather(logits, "tp", -1))

    def idle_step(self, kernels):
        """dp layout, a rank whose group has nothing to run: every MoE layer's all-to-alls with no tokens, the
        experts run on what the others send."""
        for i in range(self.cfg.num_layers):
            if self.cfg.is_moe(i):
                yield from self.experts(torch.zeros(0, self.moe_dim, dtype=self.act, device=self.device),
                                        torch.zeros(0, self.cfg.num_experts_per_token, dtype=torch.int64,
                                                    device=self.device),
                                        torch.zeros(0, self.cfg.num_experts_per_token, device=self.device),
                                        self.layers[i].ffn, kernels)

    def embed_tokens(self, ids: torch.Tensor):
        """Vocab-parallel lookup: rows outside this rank's vocabulary slice are zero, then summed over tp."""
        if self.m.tp == 1:
            return self.embed[ids]
        per = self.cfg.vocab_size // self.m.tp
        local = ids - self.m.tp_rank * per
        inside = (local >= 0) & (local < per)
        rows = self.embed[torch.where(inside, local, 0)] * inside[:, None].to(self.act)
        return (yield AllReduce(rows, "tp"))

    def kda(self, i: int, x: torch.Tensor, w: RankKDA, inp: StepInputs, pools: dict, kernels):
        """Kimi Delta Attention on x [T, D] (this rank's heads), conv windows and state advanced in place."""
        cfg, heads = self.cfg, self.local.kda_num_heads
        shape = (-1, heads, cfg.kda_head_dim)
        qkv = torch.cat([F.linear(x, w.q_proj), F.linear(x, w.k_proj), F.linear(x, w.v_proj)], dim=-1)
        conv = kernels.short_conv(qkv, w.qkv_conv, pools[f"conv_state.{i}"], inp.cu, inp.slots)
        q, k, v = (t.reshape(shape) for t in conv.chunk(3, dim=-1))
        g = ref.kda_gate(F.linear(F.linear(x, w.f_a), w.f_b).float()[None], w, self.local)[0]
        beta = torch.sigmoid(F.linear(x, w.b_proj).float())
        o = kernels.gated_delta_scan(q, k, v, g, beta, pools[f"kda_state.{i}"], inp.cu, inp.slots,
                                     cfg.kda_head_dim**-0.5)
        gate = F.linear(x, w.g_proj) if w.g_proj is not None else F.linear(F.linear(x, w.g_a), w.g_b)
        o = ref.gated_rms_norm(o, gate.view(shape), w.o_norm, cfg.rms_norm_eps).to(x.dtype)
        return (yield from self.all_reduce(F.linear(o.reshape(x.shape[0], -1), w.o_proj), "tp"))

    def mla(self, i: int, x: torch.Tensor, w: RankMLA, inp: StepInputs, pools: dict, kernels):
        """NoPE MLA absorbed over the paged latent cache (+ the DSA indexer's selection)."""
        cfg = self.cfg
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q, q_latent, latent = (t[0] if t is not None else None for t in ref.mla_project(x[None], w, self.local))
        entry = self.to_storage(latent.float())
        kernels.cache_write(pools[f"mla_cache.{i}"], entry, inp.cu, inp.tables, inp.positions)
        if w.indexer is not None:
            indices = self.last_indices = self.indexer(i, x, q_latent, w.indexer, inp, pools, kernels)
        else:
            indices = self.last_indices if self.use_indexer else None
        w_kc, w_vc = w.kv_b_heads[:, :nope], w.kv_b_heads[:, nope:]
        q_full = torch.cat([torch.einsum("thn,hnr->thr", q[..., :nope], w_kc), q[..., nope:]], dim=-1)
        o_lat = kernels.sparse_mla(q_full.float(), pools[f"mla_cache.{i}"], entry, inp.cu, inp.tables, inp.positions,
                                   indices, scale=cfg.qk_head_dim**-0.5, kv_lora_rank=r)
        o = torch.einsum("thr,hvr->thv", o_lat.to(x.dtype), w_vc)
        return (yield from self.all_reduce(ref.mla_output(o[None], x[None], w)[0], "tp"))

    def indexer(self, i: int, x: torch.Tensor, q_latent: torch.Tensor, w: ref.IndexerWeights, inp: StepInputs,
                pools: dict, kernels) -> torch.Tensor:
        """DSA lightning indexer: writes the step's keys, returns the top-k positions [T, topk] (-1 padded)."""
        hi, di = self.cfg.index_n_heads, self.cfg.index_head_dim
        q = F.linear(q_latent, w.wq_b).float().view(-1, hi, di)
        k = F.layer_norm(F.linear(x, w.wk).float(), (di,), w.k_norm_weight, w.k_norm_bias, INDEXER_KNORM_EPS)
        k = self.to_storage(k)
        pool = pools[f"index_cache.{i}"]
        kernels.cache_write(pool, k, inp.cu, inp.tables, inp.positions)
        head_w = F.linear(x, w.weights_proj).float() * ((hi**-0.5) * (di**-0.5))
        return kernels.dsa_indexer(q, head_w, pool, k, inp.cu, inp.tables, inp.positions, topk=self.topk)

    def moe(self, x: torch.Tensor, w: RankMoE, kernels):
        """Routed experts (tp layout: all-reduced over ep; dp layout: this rank's token share dispatched and
        combined, then gathered over tp), latent norm and up projection, shared experts."""
        m, tokens = self.m, x
        share = m.all_to_all and m.tp > 1
        if share:  # rows r*c .. (r+1)*c of the group's T tokens, c = ceil(T / tp)
            c = -(-x.shape[0] // m.tp)
            x = x[min(m.tp_rank * c, x.shape[0]):min((m.tp_rank + 1) * c, x.shape[0])]
        ids, weights = ref.route(x, w.router, w.router_bias, self.cfg)
        z = F.linear(x, w.latent_down) if w.latent_down is not None else x
        if m.all_to_all:
            y = yield from self.experts(z, ids, weights, w, kernels)
            if share:
                padded = torch.cat([y, y.new_zeros(c - y.shape[0], y.shape[1])])
                y = (yield AllGather(padded, "tp", 0))[: tokens.shape[0]]
        else:
            partial = kernels.moe(z, ids, weights, w.packed, **self.expert_attrs)
            y = yield from self.all_reduce(partial.to(self.act), "ep")
        y = ref.moe_combine(y, tokens, w, self.cfg)
        if w.shared_tp is not None:
            y = y + (yield from self.mlp(tokens, w.shared_tp))
        return y

    def experts(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: RankMoE, kernels):
        """dp layout: z [T, W] to its experts' ranks, this rank's experts on the rows received (the head of the
        receive buffers on the device transport: `DeviceLayout`), the weighted sums back and added per token ->
        [T, W]."""
        recv_x, recv_ids, recv_w, layout = yield Dispatch(z, ids, weights)
        bounds = layout.expert_bounds() if isinstance(layout, DeviceLayout) else {}
        partial = kernels.moe(recv_x, recv_ids, recv_w, w.packed, **self.expert_attrs, **bounds)
        return (yield Combine(partial.to(self.act), layout, z.shape[0]))

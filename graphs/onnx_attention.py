"""The attention layers of a rank graph: KDA (short conv + gated delta scan over recurrent state slots) and MLA
(NoPE, absorbed over the latent cache) with the DSA lightning indexer, tp-sharded by heads; their cache rows are
rounded to the pool's storage dtype and, where the pools stay in place, written by `PagedCacheWrite`.
"""

from __future__ import annotations

import numpy as np
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.fp8_rows import round_to_fp8_rows
from moe_export.graphs.onnx_builder import GraphBuilder
from moe_export.graphs.onnx_form import GraphForm
from moe_export.graphs.sharding import Mapping
from moe_export.graphs.weights import layer_prefix
from onnx import TensorProto

MLA_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm
INDEXER_KNORM_EPS = 1e-6


class AttentionLayers:
    """`RankGraph`'s attention blocks. Each takes layer i's normed input x [T, hidden] and its pools `io`
    (graph inputs, or pool-table rows where the pools stay in place), records the step's new states / cache rows
    in `io` where the pools are graph I/O, and returns the tp-reduced output [T, hidden]."""

    g: GraphBuilder
    cfg: ModelConfig
    m: Mapping
    form: GraphForm
    limits: object  # the recipe's limits (read by the form's pool lowering)
    kv_cache: str
    cache_type: int
    kda_heads: int
    mla_heads: int
    use_indexer: bool
    topk: int
    last_indices: str | None

    # ---- KDA ----
    def kda(self, i: int, x: str, io: dict) -> str:
        g, cfg, m, pools = self.g, self.cfg, self.m, self.form.pools
        a = layer_prefix(cfg, i) + "self_attn."
        n = f"layers.{i}.kda"
        hl, dh, w = self.kda_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        p_l = hl * dh
        qkv = g.op("Concat", [g.linear(x, f"{a}{c}_proj.weight", f"{n}.{c}_proj") for c in "qkv"], f"{n}.qkv", axis=-1)
        conv_w = g.op("Concat", [g.reshape(g.weight(f"{a}{c}_conv1d.weight", dtype=TensorProto.FLOAT), [p_l, w],
                                           f"{n}.{c}_conv_w") for c in "qkv"], f"{n}.conv_w", axis=0)  # fmt: skip
        conv_y = pools.slot_op(self, "ShortConv", [qkv, conv_w], io, "conv", "conv_out", f"{n}.conv_windows",
                               f"{n}.short_conv")
        q, k, v = (g.reshape(g.slice_last(conv_y, j * p_l, (j + 1) * p_l, f"{n}.{c}_conv"), [-1, hl, dh], f"{n}.{c}")
                   for j, c in enumerate("qkv"))
        f_b = g.to_f32(g.linear(g.linear(x, f"{a}f_a_proj.weight", f"{n}.f_a"), f"{a}f_b_proj.weight", f"{n}.f_b"), f"{n}.f_b")
        u = g.op("Add", [f_b, g.weight(f"{a}dt_bias", dtype=TensorProto.FLOAT)], f"{n}.gate_in")  # fp32 gates
        u = g.reshape(u, [-1, hl, dh], f"{n}.gate_in_heads")
        h0 = m.tp_rank * hl
        a_log = g.slice_last(g.reshape(g.weight(f"{a}A_log", dtype=TensorProto.FLOAT), [-1], f"{n}.A_log_flat"), h0, h0 + hl,
                             f"{n}.A_log_local")  # fmt: skip
        decay = g.reshape(g.op("Exp", [a_log], f"{n}.A"), [1, hl, 1], f"{n}.A_heads")
        if cfg.gate_lower_bound is not None:  # safe gate: lower_bound * sigmoid(A * u), in (lb, 0)
            s = g.op("Sigmoid", [g.op("Mul", [decay, u], f"{n}.Au")], f"{n}.gate_sigmoid")
            log_decay = g.op("Mul", [s, g.const(cfg.gate_lower_bound, np.float32, "lower_bound")], f"{n}.g")
        else:  # -A * softplus(u)
            sp = g.op("Softplus", [u], f"{n}.softplus")
            log_decay = g.op("Neg", [g.op("Mul", [decay, sp], f"{n}.A_sp")], f"{n}.g")
        beta = g.op("Sigmoid", [g.to_f32(g.linear(x, f"{a}b_proj.weight", f"{n}.b_proj"), f"{n}.b_proj")], f"{n}.beta")
        scan = dict(scale=float(dh**-0.5), use_qk_l2norm=1)
        o = pools.slot_op(self, "GatedDeltaScan", [q, k, v, log_decay, beta], io, "state", "state_out",
                          f"{n}.states", f"{n}.gated_delta_scan", **scan)
        if cfg.use_full_rank_gate:
            gate = g.linear(x, f"{a}g_proj.weight", f"{n}.g_proj")
        else:
            gate = g.linear(g.linear(x, f"{a}g_a_proj.weight", f"{n}.g_a"), f"{a}g_b_proj.weight", f"{n}.g_b")
        gate = g.reshape(gate, [-1, hl, dh], f"{n}.gate_heads")
        normed = g.rms_norm(o, f"{a}o_norm.weight", cfg.rms_norm_eps, f"{n}.o_norm")
        y = g.reshape(g.sigmoid_mul(normed, gate, f"{n}.gated"), [-1, p_l], f"{n}.o_flat")
        return g.all_reduce(g.linear(y, f"{a}o_proj.weight", f"{n}.o_proj"), "tp", m.tp, f"{n}.all_reduce")

    # ---- MLA (NoPE, absorbed over the latent cache) + DSA ----
    def mla(self, i: int, x: str, io: dict) -> str:
        g, cfg, m, pools = self.g, self.cfg, self.m, self.form.pools
        a = layer_prefix(cfg, i) + "self_attn."
        n = f"layers.{i}.mla"
        hl, nope, rope, vd, r = self.mla_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_latent = None
        if cfg.q_lora_rank:
            q_latent = g.rms_norm(g.linear(x, f"{a}q_a_proj.weight", f"{n}.q_a"), f"{a}q_a_layernorm.weight",
                                  MLA_LATENT_NORM_EPS, f"{n}.q_a_norm")
            q = g.linear(q_latent, f"{a}q_b_proj.weight", f"{n}.q_b")
        else:
            q = g.linear(x, f"{a}q_proj.weight", f"{n}.q_proj")
        q = g.op("Transpose", [g.reshape(q, [-1, hl, nope + rope], f"{n}.q_heads")], f"{n}.q_hT", perm=[1, 0, 2])
        q_nope = g.slice_last(q, 0, nope, f"{n}.q_nope")  # [H, T, nope]
        q_pe = g.slice_last(q, nope, nope + rope, f"{n}.q_pe")
        kv_b = g.reshape(g.weight(f"{a}kv_b_proj.weight"), [hl, nope + vd, r], f"{n}.kv_b_heads")
        w_kc = g.op("Slice", [kv_b, g.const([0]), g.const([nope]), g.const([1])], f"{n}.w_kc")  # [H, nope, r]
        w_vc = g.op("Slice", [kv_b, g.const([nope]), g.const([nope + vd]), g.const([1])], f"{n}.w_vc")  # [H, v, r]
        q_lat = g.op("MatMul", [q_nope, w_kc], f"{n}.q_absorb")  # [H, T, r]
        q_full = g.op("Transpose", [g.op("Concat", [q_lat, q_pe], f"{n}.q_cat", axis=-1)], f"{n}.q_lat", perm=[1, 0, 2])
        ckv = g.linear(x, f"{a}kv_a_proj_with_mqa.weight", f"{n}.kv_a")
        c = g.rms_norm(g.slice_last(ckv, 0, r, f"{n}.c"), f"{a}kv_a_layernorm.weight", MLA_LATENT_NORM_EPS, f"{n}.c_norm")
        entry = g.op("Concat", [c, g.slice_last(ckv, r, r + rope, f"{n}.k_pe")], f"{n}.cache_entry", axis=-1)
        entry = self.round_to_storage(g.to_f32(entry, f"{n}.cache_entry"), f"{n}.cache_rows")
        entry = pools.cache_rows(self, entry, io, "mla", "mla_out", f"{n}.cache_write")
        # Dense layers pass an empty [0, 0] index tensor (the op's "dense causal" form), so the node always
        # has the six inputs TensorRT's plugin signature fixes.
        if self.use_indexer and cfg.has_indexer(i):
            indices = self.last_indices = self.indexer(i, x, q_latent, io)
        elif self.use_indexer:  # "shared" layer: reuse the previous full layer's selection
            indices = self.last_indices
        else:
            indices = g.const(np.zeros((0, 0)), np.int64, "dense")
        attn_inputs = [g.to_f32(q_full, f"{n}.q_lat"), pools.paged_pool(io, "mla"), entry, io["cu"], io["tables"],
                       io["positions"], indices]
        o_lat = g.plugin("SparseMLAAttention", attn_inputs, f"{n}.attention",
                         scale=float((nope + rope) ** -0.5), kv_lora_rank=r, **pools.pool_attributes(self, io["mla"]))
        o_t = g.op("Transpose", [g.to_act(o_lat, f"{n}.attention")], f"{n}.o_latT", perm=[1, 0, 2])  # [H, T, r]
        o = g.op("MatMul", [o_t, g.op("Transpose", [w_vc], f"{n}.w_vcT", perm=[0, 2, 1])], f"{n}.v_up")  # [H, T, v]
        y = g.reshape(g.op("Transpose", [o], f"{n}.oT", perm=[1, 0, 2]), [-1, hl * vd], f"{n}.o_flat")
        if cfg.mla_use_output_gate:
            y = g.sigmoid_mul(y, g.linear(x, f"{a}g_proj.weight", f"{n}.g_proj"), f"{n}.gated")
        return g.all_reduce(g.linear(y, f"{a}o_proj.weight", f"{n}.o_proj"), "tp", m.tp, f"{n}.all_reduce")

    def indexer(self, i: int, x: str, q_latent: str, io: dict) -> str:
        """DSA lightning indexer: writes this step's keys, returns top-k indices [T, topk] (-1 padded)."""
        g, cfg, pools = self.g, self.cfg, self.form.pools
        a = layer_prefix(cfg, i) + "self_attn.indexer."
        n = f"layers.{i}.indexer"
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        q = g.reshape(g.to_f32(g.linear(q_latent, f"{a}wq_b.weight", f"{n}.wq_b"), f"{n}.wq_b"), [-1, hi, di], f"{n}.q")
        k = g.op("LayerNormalization", [g.to_f32(g.linear(x, f"{a}wk.weight", f"{n}.wk"), f"{n}.wk"),
                                        g.weight(f"{a}k_norm.weight", dtype=TensorProto.FLOAT),
                                        g.weight(f"{a}k_norm.bias", dtype=TensorProto.FLOAT)],
                 f"{n}.k_norm", axis=-1, epsilon=INDEXER_KNORM_EPS)  # fmt: skip
        k = self.round_to_storage(k, f"{n}.cache_rows")
        k = pools.cache_rows(self, k, io, "index", "index_out", f"{n}.cache_write")
        # score[t, s] = sum_h (w[t, h] * Hi^-0.5 * Di^-0.5) * relu(q[t, h] . k[s]); the op applies relu and sums.
        weights = g.op("Mul", [g.to_f32(g.linear(x, f"{a}weights_proj.weight", f"{n}.weights_proj"), f"{n}.weights_proj"),
                               g.const((hi**-0.5) * (di**-0.5), np.float32, "index_scale")], f"{n}.head_weights")
        inputs = [q, weights, pools.paged_pool(io, "index"), k, io["cu"], io["tables"], io["positions"]]
        return pools.indexer(self, inputs, io, "index", f"{n}.topk")

    def round_to_storage(self, rows: str, name: str) -> str:
        """fp32 cache rows [T, D] rounded to the pool's storage dtype (kept fp32: the runtime stores them exactly)."""
        if self.cache_type == TensorProto.FLOAT:
            return rows
        if self.cache_type == TensorProto.UINT8:
            return round_to_fp8_rows(self.g, rows, name)
        stored = self.g.op("Cast", [rows], f"{name}.stored", to=self.cache_type)
        return self.g.op("Cast", [stored], name, to=TensorProto.FLOAT)

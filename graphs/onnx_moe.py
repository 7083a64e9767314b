"""The feed-forward layers of a rank graph: dense SwiGLU / SiTU MLPs (tp-sharded) and the MoE layer (sigmoid
router with bias correction and optional group limit, MXFP4 experts sliced over the ep group, optional latent
down/up projection, shared experts). The experts' partial sums are all-reduced over the ep group; in the `dp`
layout (`graphs/sharding.py`) each MoE layer instead dispatches its tokens with `MoEDispatch` and sums the
experts' results with `MoECombine` (all-to-all, `plugins/collectives/all_to_all.py`).
"""

from __future__ import annotations

import numpy as np
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.onnx_builder import GraphBuilder
from moe_export.graphs.onnx_form import GraphForm
from moe_export.graphs.sharding import Mapping
from moe_export.graphs.weights import layer_prefix
from onnx import TensorProto, helper


class FeedForwardLayers:
    """`RankGraph`'s FFN blocks over a normed input x [T, hidden] -> [T, hidden]."""

    g: GraphBuilder
    cfg: ModelConfig
    m: Mapping
    form: GraphForm
    limits: object  # the recipe's limits (read by the form's pool lowering)
    mxfp4_type: int

    def mlp(self, x: str, prefix: str, name: str, group_size: int) -> str:
        g = self.g
        gate = g.linear(x, f"{prefix}gate_proj.weight", f"{name}.gate_proj")
        up = g.linear(x, f"{prefix}up_proj.weight", f"{name}.up_proj")
        y = g.linear(g.gated_act(gate, up, self.cfg, f"{name}.act"), f"{prefix}down_proj.weight", f"{name}.down_proj")
        return g.all_reduce(y, "tp", group_size, f"{name}.all_reduce")

    def group_limit(self, choice: str, n: str) -> str:
        """Group-limited routing (DeepSeek-V3): choice scores [T, E] -> the same with every expert outside the
        topk_group groups of best top-2 sum set to -inf (E experts in num_expert_group equal groups)."""
        g, cfg = self.g, self.cfg
        groups, per = cfg.num_expert_group, cfg.num_experts // cfg.num_expert_group
        grouped = g.op("Reshape", [choice, g.const([0, groups, per])], f"{n}.grouped")  # [T, G, E/G]
        top2, _ = g.op("TopK", [grouped, g.const([2])], f"{n}.group_top2", 2, axis=-1)
        group_score = g.op("ReduceSum", [top2, g.const([-1])], f"{n}.group_score", keepdims=0)  # [T, G]
        _, kept = g.op("TopK", [group_score, g.const([cfg.topk_group])], f"{n}.group_topk", 2, axis=-1)
        def filled(like: str, value: float, name: str) -> str:
            return g.op("ConstantOfShape", [g.op("Shape", [like], f"{name}.shape")], name,
                        value=helper.make_tensor("value", TensorProto.FLOAT, [1], [value]))

        mask = g.op("ScatterElements", [filled(group_score, 0.0, f"{n}.zeros"), kept, filled(kept, 1.0, f"{n}.ones")],
                    f"{n}.group_mask", axis=-1)  # [T, G]: 1 for the kept groups
        keep = g.op("Cast", [g.op("Unsqueeze", [mask, g.const([-1])], f"{n}.group_mask3")], f"{n}.keep",
                    to=TensorProto.BOOL)
        masked = g.op("Where", [keep, grouped, g.const(float("-inf"), np.float32, "neg_inf")], f"{n}.masked")
        return g.op("Reshape", [masked, g.const([0, cfg.num_experts])], f"{n}.choice_grouped")

    def token_share(self, x: str, name: str) -> tuple[str, str, str]:
        """This rank's rows of x [T, D] in the dp layout: rows r*c .. min((r+1)*c, T) of its tp group's tokens,
        r = tp_rank, c = ceil(T / tp) (the tp ranks' shares in rank order are the T rows once). Returns the share
        and, for `gather_shares`, T [1] and the rows it lacks to c [1] (only the last ranks lack rows)."""
        g, m = self.g, self.m
        rows = g.op("Shape", [x], f"{name}.shape", end=1)  # [1]
        share = g.op("Div", [g.op("Add", [rows, g.const([m.tp - 1])], f"{name}.rows_up"), g.const([m.tp])], f"{name}.share")
        start = g.op("Min", [g.op("Mul", [share, g.const([m.tp_rank])], f"{name}.start_raw"), rows], f"{name}.start")
        end = g.op("Min", [g.op("Add", [start, share], f"{name}.end_raw"), rows], f"{name}.end")
        short = g.op("Sub", [share, g.op("Sub", [end, start], f"{name}.taken")], f"{name}.short")
        return g.op("Slice", [x, start, end, g.const([0])], name), rows, short

    def gather_shares(self, y: str, rows: str, short: str, name: str) -> str:
        """The tp group's shares y [rows taken, D] back as [T, D]: each padded with zero rows to c (at most tp - 1
        rows in all, so every rank gathers an equal block, the static shape TensorRT's AllGather needs), gathered
        in rank order (the padding lands after the T real rows) and cut to T."""
        g, m = self.g, self.m
        pads = g.op("Concat", [g.const([0, 0]), short, g.const([0])], f"{name}.pads", axis=0)
        padded = g.op("Pad", [y, pads], f"{name}.padded")
        gathered = g.collective("AllGather", [padded], name, group="tp", axis=0, group_size=m.tp)
        return g.op("Slice", [gathered, g.const([0]), rows, g.const([0])], f"{name}.rows")

    def moe(self, i: int, x: str) -> str:
        g, cfg, m = self.g, self.cfg, self.m
        p = layer_prefix(cfg, i) + "block_sparse_moe."
        n = f"layers.{i}.moe"
        tokens = x
        if m.all_to_all and m.tp > 1:  # each tp rank routes and dispatches its share of the group's tokens
            x, rows_taken, short = self.token_share(x, f"{n}.token_share")
        router = g.to_f32(g.linear(x, f"{p}gate.weight", f"{n}.router"), f"{n}.router")  # fp32-accumulated logits
        scores = g.op("Sigmoid", [router], f"{n}.scores")  # fp32 [T, E]
        choice = g.op("Add", [scores, g.weight(f"{p}gate.e_score_correction_bias", dtype=TensorProto.FLOAT)], f"{n}.choice")
        if cfg.num_expert_group > 1:
            choice = self.group_limit(choice, n)
        _, ids = g.op("TopK", [choice, g.const([cfg.num_experts_per_token])], f"{n}.topk", 2, axis=-1)
        w = g.op("GatherElements", [scores, ids], f"{n}.weights", axis=-1)
        if cfg.moe_renormalize:
            total = g.op("ReduceSum", [w, g.const([-1])], f"{n}.wsum", keepdims=1)
            w = g.op("Div", [w, g.op("Add", [total, g.const(1e-20, np.float32, "tiny")], f"{n}.wsum_eps")], f"{n}.wnorm")
        if cfg.routed_scaling_factor != 1.0:
            w = g.op("Mul", [w, g.const(cfg.routed_scaling_factor, np.float32, "routed_scale")], f"{n}.wscaled")
        z = g.linear(x, f"{p}routed_expert_down_proj.weight", f"{n}.latent_down") if cfg.routed_expert_hidden_size else x
        e = f"{p}experts."
        if m.all_to_all:  # the tokens go to their experts' ranks; the expert op sees the rows it received
            dispatched = z
            z, ids, w, *layout = g.collective("MoEDispatch", [z, ids, w], f"{n}.dispatch", 6, group="ep",
                                          num_experts=cfg.num_experts, **self.form.pools.dispatch_attributes(self))
        experts = [g.weight(e + t, as_float=False, byte_view=self.mxfp4_type)
                   for t in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")]
        act_in = g.to_f32(z, f"{n}.experts_in")
        received = layout[2] if m.all_to_all else None  # after a dispatch: the count of rows received [1]
        act_in, extra = self.form.pools.experts_inputs(self, z, act_in, experts, received)
        partial = g.plugin(
            "MoEMXFP4",
            [act_in, ids, w] + experts,
            f"{n}.experts",
            expert_offset=m.local_experts(cfg.num_experts).start,
            activation=cfg.hidden_act,
            situ_beta=float(cfg.situ_beta or 0.0),
            situ_linear_beta=float(cfg.situ_linear_beta or 0.0),
            **extra,
        )
        if extra:
            partial = partial[0]  # output 1, the workspace, is only written and read by the plugin itself
        else:
            partial = g.to_act(partial, f"{n}.experts")
        if m.all_to_all:  # back to the tokens' ranks, summed per token (latent space)
            y = g.collective("MoECombine", [partial, *layout, dispatched], f"{n}.combine", group="ep")
            if m.tp > 1:
                y = self.gather_shares(y, rows_taken, short, f"{n}.token_all_gather")
        else:
            y = g.all_reduce(partial, "ep", m.ep, f"{n}.experts_all_reduce")  # latent space
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                y = g.rms_norm(y, f"{p}routed_expert_norm.weight", cfg.rms_norm_eps, f"{n}.latent_norm")
            y = g.linear(y, f"{p}routed_expert_up_proj.weight", f"{n}.latent_up")
        if cfg.num_shared_experts:
            y = g.op("Add", [y, self.mlp(tokens, f"{p}shared_experts.", f"{n}.shared", m.tp)], f"{n}.out")
        return y

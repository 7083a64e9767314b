"""Tensor and expert parallelism as a few explicit functions (gpt-fast style).

Mapping (TensorRT-LLM users know it): `world_size` ranks; attention, dense and shared FFNs are
tensor-parallel inside groups of `tp` consecutive ranks; routed experts are split into `ep`
contiguous slices of whole experts, one per rank of each group of `ep` consecutive ranks. Embedding and
lm_head are vocab-parallel over the tp group. Two layouts (recipe `parallel.attention`):

  tp  every rank runs the same batch; routing is replicated and the experts' partial sums are
      all-reduced over the ep group in the latent space (before `routed_expert_norm`, as K3 requires).
  dp  the world is `dp = world_size / tp` attention groups (the tp groups), each with its own requests;
      experts are spread over all ranks (ep = world_size). Each rank routes its share of its group's
      tokens (rows tp_rank*c .. of the step's T, c = ceil(T / tp)) and an all-to-all sends each token only
      to the ranks holding its chosen experts (`MoEDispatch`), which return their weighted partial sums
      (`MoECombine`, still in the latent space); an all-gather over the tp group reassembles the rows.
"""

from __future__ import annotations

from typing import Literal

import torch
from moe_export.common.errors import InputError
from moe_export.common.mapping import Mapping
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import TensorSpec

SplitKind = Literal["replicated", "column", "row", "vocab", "expert", "heads"]


def check_divisibility(cfg: ModelConfig, tp: int, ep: int) -> None:
    """Refuse a parallel layout the model cannot be split into, naming the dimension."""
    problems = []
    checks = [
        ("num_attention_heads", cfg.num_heads, tp),
        ("linear_attn_config.num_heads", cfg.kda_num_heads, tp),
        ("intermediate_size", cfg.intermediate_size, tp),
        ("vocab_size", cfg.vocab_size, tp),
    ]
    if cfg.num_shared_experts:
        checks.append(("shared experts width", cfg.shared_intermediate_size, tp))
    if cfg.num_experts:
        checks.append(("num_experts", cfg.num_experts, ep))
    for name, dim, by in checks:
        if dim % by:
            problems.append(f"{name}={dim} is not divisible by {'ep' if name == 'num_experts' else 'tp'}={by}")
    if problems:
        raise InputError("parallel layout does not fit the model: " + "; ".join(problems))


def split_kind(spec: TensorSpec) -> SplitKind:
    """How a checkpoint tensor is distributed: column = split dim 0 by heads/rows, row = split dim 1."""
    name, cls = spec.name, spec.weight_class
    if cls == "routed_experts":
        return "expert"
    if cls in ("embeddings", "lm_head"):
        return "vocab"
    if cls in ("dense", "shared_experts"):
        return "row" if name.endswith("down_proj.weight") else "column"
    if cls == "kda":
        if name.endswith("o_proj.weight"):
            return "row"
        replicated = ("f_a_proj.weight", "g_a_proj.weight", "A_log", "o_norm.weight")
        return "replicated" if name.endswith(replicated) else "column"
    if cls == "mla":
        if name.endswith("o_proj.weight"):
            return "row"
        column = ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "g_proj.weight")
        return "column" if name.endswith(column) else "replicated"
    return "replicated"  # norms, attn_res, router, latent projections, indexer


def shard_range(spec: TensorSpec, mapping: Mapping) -> tuple[int, int, int] | None:
    """(dim, start, stop): the index range of `spec` this rank holds along one dimension (torch.chunk's
    split), or None when the rank holds the whole tensor."""
    kind = split_kind(spec)
    if kind == "expert":
        raise ValueError(f"{spec.name}: routed expert tensors are selected whole, not sliced")
    size, rank = mapping.tp, mapping.tp_rank
    if kind == "replicated" or size == 1:
        return None
    dim = 1 if kind == "row" else 0
    step = -(-spec.shape[dim] // size)
    return dim, min(rank * step, spec.shape[dim]), min((rank + 1) * step, spec.shape[dim])


def shard_tensor(spec: TensorSpec, tensor: torch.Tensor, mapping: Mapping) -> torch.Tensor:
    """This rank's slice of a (non-expert) checkpoint tensor, as a contiguous copy."""
    part = shard_range(spec, mapping)
    if part is None:
        return tensor
    dim, start, stop = part
    return tensor.narrow(dim, start, stop - start).contiguous()


def rank_numel(spec: TensorSpec, mapping: Mapping, num_experts: int) -> int:
    """Logical parameters of `spec` held by this rank (MXFP4 tensors count their unpacked elements)."""
    if split_kind(spec) == "expert":
        if spec.expert not in mapping.local_experts(num_experts):
            return 0
        if spec.logical_shape is not None and spec.name.endswith("weight_scale"):
            return 0  # counted once with weight_packed
        shape = spec.logical_shape or spec.shape
        n = 1
        for d in shape:
            n *= d
        return n
    kind = split_kind(spec)
    if kind == "replicated":
        return spec.numel
    return spec.numel // mapping.tp

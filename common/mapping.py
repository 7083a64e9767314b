"""`Mapping`: one rank's place in the world (TensorRT-LLM's idea): tp groups of consecutive ranks for attention,
dense and shared FFNs, ep groups of consecutive ranks holding contiguous slices of whole routed experts, and
in the dp layout `world_size / tp` attention groups with their own requests (`graphs/sharding.py` says how
tensors are split over it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from moe_export.common.errors import InputError

if TYPE_CHECKING:
    from moe_export.common.recipe import Recipe


@dataclass(frozen=True)
class Mapping:
    """One rank's place in the world: tp group (attention/FFN shards) and ep group (expert slices)."""

    world_size: int
    rank: int
    tp: int
    ep: int
    attention: Literal["tp", "dp"] = "tp"  # dp: data-parallel attention groups, all-to-all expert dispatch

    def __post_init__(self) -> None:
        for name, val in (("tp", self.tp), ("ep", self.ep)):
            if val < 1 or self.world_size % val:
                raise InputError(f"mapping: {name}={val} must divide world_size={self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"mapping: rank {self.rank} outside 0..{self.world_size - 1}")
        if self.attention not in ("tp", "dp"):
            raise InputError(f"mapping: attention must be tp or dp, got {self.attention!r}")
        if self.attention == "dp" and self.ep != self.world_size:
            raise InputError(f"mapping: data-parallel attention spreads the experts over every rank: ep={self.ep} "
                             f"must equal world_size={self.world_size}")

    @property
    def all_to_all(self) -> bool:
        """MoE tokens are dispatched to their experts' ranks (dp layout), not routed on every rank and all-reduced."""
        return self.attention == "dp"

    @property
    def dp(self) -> int:
        """Attention groups with their own requests: world_size / tp in the dp layout, else 1."""
        return self.world_size // self.tp if self.all_to_all else 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp if self.all_to_all else 0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def tp_group(self) -> tuple[int, ...]:
        start = self.rank - self.tp_rank
        return tuple(range(start, start + self.tp))

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def ep_group(self) -> tuple[int, ...]:
        start = self.rank - self.ep_rank
        return tuple(range(start, start + self.ep))

    def group_index(self, kind: str) -> int:
        """Which group of `kind` ("tp" or "ep": consecutive ranks) this rank is in, counted from 0."""
        return self.rank // self.group_size(kind)

    def group_size(self, kind: str) -> int:
        if kind not in ("tp", "ep"):
            raise ValueError(f"group kind must be 'tp' or 'ep', got {kind!r}")
        return self.tp if kind == "tp" else self.ep

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of `kind` ("tp" or "ep") in the world, in rank order, each as its world ranks."""
        size = self.group_size(kind)
        return [tuple(range(start, start + size)) for start in range(0, self.world_size, size)]

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the routed experts this rank holds (a contiguous slice)."""
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def max_recv_rows(self, max_num_tokens: int) -> int:
        """dp layout: the most rows one rank's MoEDispatch can receive in a step, the static bound of the TensorRT
        receive buffers. Each source routes its share of its group's tokens (at most ceil(max_num_tokens / tp))
        and sends each token at most once to a rank, so ep * ceil(max_num_tokens / tp), whatever the groups'
        batches (DeepEP and TensorRT-LLM's wide-EP buffers are likewise sized from a max tokens per rank)."""
        return self.ep * -(-max_num_tokens // self.tp)

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "tp_size": self.tp,
            "tp_rank": self.tp_rank,
            "ep_size": self.ep,
            "ep_rank": self.ep_rank,
            "attention": self.attention,
            "dp_size": self.dp,
            "dp_rank": self.dp_rank,
        }

    def layout_dict(self) -> dict:
        """The world's layout without this rank's place (config.json's `mapping`)."""
        return {"world_size": self.world_size, "tp_size": self.tp, "ep_size": self.ep, "attention": self.attention}

    @classmethod
    def from_dict(cls, data: dict) -> Mapping:
        """The inverse of `to_dict` (derived fields are recomputed, not read)."""
        return cls(world_size=data["world_size"], rank=data["rank"], tp=data["tp_size"], ep=data["ep_size"],
                   attention=data.get("attention", "tp"))

    @classmethod
    def from_recipe(cls, recipe: Recipe, rank: int) -> Mapping:
        """Rank `rank`'s place in the world a recipe describes."""
        p = recipe.parallel
        return cls(world_size=recipe.target.world_size, rank=rank, tp=p.tp, ep=p.ep, attention=p.attention)

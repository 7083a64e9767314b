"""What a backend asks of a rank graph (`GraphForm`) and the cache pools' storage: element types and, for graphs
whose pools stay in place, the pool table input and metadata key.

Compute dtype. CPU builds (backend onnxruntime) compute in fp32. GPU builds (backend tensorrt) compute in
bf16: bf16 weights are used as stored (TensorRT folds a Cast of an initializer into a converted copy, so an
fp32 graph would hold every weight in fp32), activations, GEMMs and collectives are bf16, and fp32 stays where
the model needs it: router scores (from the bf16 GEMM's logits) and top-k, KDA gates (A_log, dt_bias, decay,
beta) and recurrent state, conv taps, RMS / layer norm and attention-residual arithmetic, the plugins' fp32
inputs, caches and logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_export.common.errors import InputError
from onnx import TensorProto

# recipe kv_cache -> pool element type; fp8 pools are uint8 rows of E4M3 codes + one E8M0 scale byte
# (`moe_export.quantize.fp8_cache`), so their last dim is D + 1
CACHE_STORAGE = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "fp8": TensorProto.UINT8}
# graphs whose pools stay in place: metadata key of the pools in pool-table row order (name, element type, dims), and
# the pool table input [P, 3] int64 (plugins/pool_table.py)
POOLS_KEY = "pools"
POOL_TABLE = "pool_table"


@dataclass(frozen=True)
class PoolsAsGraphIO:
    """How a rank graph reaches its state pools (ONNX Runtime's form, and the interface a backend's own form
    implements): every pool is a graph input; the step's sequences' states / windows are gathered from it (local
    slots 0..N-1) and their new values, and the step's new cache rows, are graph outputs (`<pool>.out`, recorded in
    the layer's `io` under `out_key`), which the runtime writes back (O(tokens), not O(pool)). `rg` is the
    `RankGraph` being built (its builder `g`, `limits`, `kv_cache`, mapping `m`, config `cfg`, `pools`)."""

    mxfp4_type = TensorProto.UINT8  # MXFP4 bytes and E8M0 scales as the MoE plugin receives them

    def pool(self, rg, name: str, elem: int, dims: list):
        """A pool of the layer: what its readers name (here the graph input's name)."""
        return rg._input(name, elem, dims)

    def slot_op(self, rg, op: str, inputs: list[str], io: dict, pool: str, out_key: str, gathered: str, name: str,
                **attrs) -> str:
        """A recurrent op (ShortConv, GatedDeltaScan) over the slots of pool `io[pool]` [S, ...]: the step's rows
        gathered as `gathered` [N, ...], the op's new rows recorded as `io[out_key]`; returns its output."""
        g = rg.g
        state_in = g.op("Gather", [io[pool], io["slots"]], gathered, axis=0)
        y, state_out = g.plugin(op, [*inputs, state_in, io["cu"], io["local_slots"]], name, 2, **attrs)
        io[out_key] = state_out
        return y

    def cache_rows(self, rg, rows: str, io: dict, pool: str, out_key: str, name: str) -> str:
        """The step's cache rows [T, D] fp32 (rounded to storage) for pool `io[pool]`: a graph output here; returns
        the rows the pool's readers take."""
        io[out_key] = rows
        return rows

    def paged_pool(self, io: dict, pool: str) -> str:
        """What a paged-cache reader takes as its pool input."""
        return io[pool]

    def pool_attributes(self, rg, pool) -> dict:
        """A paged-cache op's attributes for its pool (none here)."""
        return {}

    def indexer(self, rg, inputs: list[str], io: dict, pool: str, name: str) -> str:
        """The DSAIndexer node over `inputs`; returns its top-k indices [T, topk]."""
        return rg.g.plugin("DSAIndexer", inputs, name, topk=int(rg.topk))

    def dispatch_attributes(self, rg) -> dict:
        """MoEDispatch's attributes beyond the group's and the experts' count (none here: dynamic shapes)."""
        return {}

    def experts_inputs(self, rg, z: str, act_in: str, experts: list[str], received: str | None) -> tuple[str, dict]:
        """The MoE plugin's activations input and extra attributes (`z`: the activations as computed, `act_in`: as
        fp32; `experts`: its weight inputs, which a form may extend; `received`: the rows a dispatch received, or
        None): fp32 activations, one output here."""
        return act_in, {}

    def finish(self, rg) -> list[tuple[str, str]]:
        """After the layers: adds the inputs the pools need and returns the model's metadata entries for them."""
        return []


@dataclass(frozen=True)
class GraphForm:
    """What a backend asks of a rank graph. compute_dtype: ONNX element type of activations (and of weights used
    as stored); pools: how the graph reaches the state pools (`PoolsAsGraphIO`, or the backend's own object with
    the same methods, e.g. TensorRT's pools updated in place through a pool table); ordered_collectives: every
    collective node takes one more input, `after` (the graph's previous collective's first output; the first one's:
    its own input), so that every two collectives are ordered by a data path: an engine that orders its layers by
    data dependencies alone runs them in the graph's order, the same on every rank (`GraphBuilder.collective`; the
    ONNX Runtime backend runs them between segments in the graph's order anyway)."""

    compute_dtype: int = TensorProto.FLOAT
    pools: PoolsAsGraphIO = field(default_factory=PoolsAsGraphIO)
    ordered_collectives: bool = False


def cache_storage_type(kv_cache: str) -> int:
    """ONNX element type of the cache pools for the recipe's `quantization.kv_cache`."""
    if kv_cache not in CACHE_STORAGE:
        raise InputError(f"quantization.kv_cache {kv_cache!r}: the graphs store caches as one of "
                         f"{sorted(CACHE_STORAGE)}")
    return CACHE_STORAGE[kv_cache]

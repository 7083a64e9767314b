"""The model-runner interface the engine core drives: `ort.Engine` (ONNX Runtime), `tensorrt.TensorRTEngine`
and `reference.ReferenceEngine` implement it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from moe_export.common.engine_config import EngineConfig
from moe_export.runtime.engine.batch import StepBatch
from moe_export.runtime.engine.sampler import SampledTokens, SamplingBatch, sample


class ModelRunner(Protocol):
    """One step of a packed batch over the runner's state pools.

    Limits the scheduler plans within (every runner validates a step with `batch.check_step_batch`):
    num_slots recurrent-state slots, num_blocks cache blocks of block_size tokens, max_seq_len,
    max_num_tokens per step, max_step_pairs (step token x attended position) per step or None. config: the
    engine's config.json as an `export.engine_config.EngineConfig` (None for the reference model, which is not
    built); model_config: its HF config. Multi-rank: comm (broadcast of step plans; None in one process), is_root.
    vision: the image tower (`engine.vision.VisionEncoder`) or None (text only; a runner with one is a
    `VisionRunner`); dp_layout: attention groups with their own batches (a runner under mpiexec with it is a
    `GroupedRunner`)."""

    num_slots: int
    num_blocks: int
    block_size: int
    max_seq_len: int
    max_num_tokens: int
    max_step_pairs: int | None
    num_checkpoints: int
    checkpoint_interval: int
    world_size: int
    comm: StepCommunicator | None
    is_root: bool
    config: EngineConfig | None
    model_config: dict
    vision: object | None
    dp_layout: bool

    def reset_slot(self, slot: int) -> None:
        """Start a new sequence in `slot` (zero its recurrent state)."""

    def save_state(self, slot: int, checkpoint: int) -> None:
        """Copy `slot`'s recurrent state rows (KDA state, conv windows) into checkpoint `checkpoint`, after the
        step that brought the slot to a cached block boundary (ordered after that step on a device stream)."""

    def restore_state(self, slot: int, checkpoint: int) -> None:
        """Copy checkpoint `checkpoint` into `slot`'s recurrent state rows (a new sequence resuming from a cached
        prefix, instead of `reset_slot`; ordered before the next step)."""

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        """The cache pools' rows of `blocks` as uint8 [n, bytes] per pool key `{rank}/{pool}` (ordered after the work
        queued before it): for the offload store and the copy-on-write of a partial block (`StepPlan.copies`)."""

    def write_blocks(self, blocks: list[int], rows: dict) -> None:
        """Write rows read by `read_blocks` into `blocks` (ordered before the next step): per pool key the blocks'
        rows in order, an [n, bytes] array or n [bytes] arrays (the offload store's own: a host runner writes each
        into its place, a device runner gathers them for one copy to the device)."""

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one step; logits [N, vocab] fp32 on the host (parity checks)."""

    def sample(self, batch: StepBatch | None, sampling: SamplingBatch | None) -> SampledTokens | None:
        """Run one step and choose the tokens of `sampling.rows` where the logits are (None: a follower
        rank's step, or an idle step of a dp-layout group): only ids and asked-for logprobs come back. Choosing
        (`choose_tokens`) fails requests, never the step: the step itself ran on every rank."""


class OffloadRunner(ModelRunner, Protocol):
    """A runner whose state rows can be read and written as raw bytes on the host, for the offload store
    (`runtime.core.state_offload`; ONNX Runtime, torch and TensorRT runners). Rows are keyed `{rank}/{pool}` and
    are uint8: a recurrent-state row [bytes], cache blocks [n, bytes] (any pool dtype: `ModelRunner.read_blocks`). A
    read is ordered after the work queued before it (a device runner waits for its stream)."""

    def state_layout(self) -> dict[str, list]:
        """Per pool key: [kind ("state": recurrent rows by slot | "cache": paged blocks), bytes of one row (a slot's or
        a block's), dtype, row shape]."""

    def read_slot(self, slot: int) -> dict[str, np.ndarray]:
        """`slot`'s recurrent-state rows."""

    def read_checkpoint(self, checkpoint: int) -> dict[str, np.ndarray]:
        """Checkpoint `checkpoint`'s recurrent-state rows (as `save_state` wrote them)."""

    def write_slot(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """Set `slot`'s recurrent state to rows read by `read_slot` / `read_checkpoint` (instead of `reset_slot`)."""


class StepCommunicator(Protocol):
    """The host side of a multi-rank runner: `broadcast` of rank 0's step plans (in the world, or in the attention
    group in the dp layout), the MPI `world`, and `leaders` (the groups' first ranks; None elsewhere)."""

    world: object
    leaders: object | None

    def broadcast(self, obj): ...

    def group_sum(self, x: np.ndarray) -> np.ndarray: ...


class VisionRunner(ModelRunner, Protocol):
    """A runner with an image tower (`vision` is not None): a step's image rows take `image_width`-wide
    embeddings; `media_pad_id` is the prompt token each image row stands on."""

    image_width: int
    media_pad_id: int

    def encode_images(self, items: list) -> list[np.ndarray]:
        """Run the tower on (pixel_values, grid) items, packed: each image's embeddings [tokens_i, image_width]."""


class GroupedRunner(ModelRunner, Protocol):
    """A dp-layout runner under mpiexec: `dp` attention groups, this rank's `group`; per-expert routed token
    counts [MoE layers, experts] of its group's last step (`group_step_expert_tokens`) and in all (`expert_tokens`)."""

    comm: StepCommunicator
    dp: int
    group: int
    expert_tokens: np.ndarray
    group_step_expert_tokens: np.ndarray


class StepRefused(RuntimeError):
    """Every rank of a world step refused to run it, by agreement before any collective (one rank's step failed
    validation, `TensorRTEngine._agree_bucket`): nothing collective is half done, so the step's requests fail and
    every rank goes on (`core.execution`)."""


def wait_for_step(sampled: SampledTokens | None, synchronize: Callable[[], None]) -> None:
    """A step's one host wait: for the sampled ids' copy when the step sampled on the device (`SampledTokens.copy_pending`:
    that copy follows every other copy of the step in stream order, so the step's per-expert counts are on the host
    too), else `synchronize()` (the step's stream)."""
    if sampled is not None and sampled.copy_pending:
        sampled.wait()
    else:
        synchronize()


def choose_tokens(logits, sampling: SamplingBatch) -> SampledTokens:
    """The sampler on a step's logits [N, V] (`sampler.sample`, on their device), its failure kept to the requests
    it chose for: choosing happens where the logits are (rank 0, or a dp group's leader) after everything collective
    in the step, so an exception there fails the step's sampled rows (each with the error, `SampledTokens.errors`;
    the sampler does not say which row caused it) while the engine and every other rank go on."""
    try:
        return sample(logits, sampling)
    except Exception as exc:
        n = int(sampling.rows.numel())
        why = f"choosing its token failed: {type(exc).__name__}: {exc}"
        return SampledTokens(np.zeros(n, dtype=np.int64), [None] * n, [None] * n, dict.fromkeys(range(n), why))

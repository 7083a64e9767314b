"""What the planner counts for each backend (`BackendTerms`, by the recipe's `backend`).

weight_bytes: bytes per element of a non-fp32 weight as the built engine holds it (what its graph computes in: 2 for
bf16, 4 for fp32); engine_memory: the planner counts an engine's activation memory and plugin workspaces on the GPU
(else they stay within the reserve); tower_scores: K3's tower materializes each image's attention scores (no flash
attention), which the planner counts in its activations; nccl: the collectives run over NCCL, whose device buffers
the planner counts beside the engine (`memory.nccl_buffer_bytes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_export.common.recipe import Recipe


@dataclass(frozen=True)
class BackendTerms:
    weight_bytes: Callable[[Recipe], float] = lambda recipe: 4.0
    engine_memory: bool = False
    tower_scores: bool = True
    nccl: bool = False


BACKEND_TERMS = {
    "onnxruntime": BackendTerms(),  # fp32 graphs on CPU
    "tensorrt": BackendTerms(weight_bytes=lambda recipe: 2.0, engine_memory=True, tower_scores=False, nccl=True),
    # the PyTorch runner holds weights in its compute dtype: fp32 on CPU, bf16 on GPUs
    "torch": BackendTerms(weight_bytes=lambda recipe: 4.0 if recipe.target.gpu == "cpu" else 2.0),
}


def backend_terms(recipe: Recipe) -> BackendTerms:
    """The planner's terms for the backend the recipe builds for."""
    return BACKEND_TERMS[recipe.backend]

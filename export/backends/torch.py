"""Backend `torch`: each rank's converted weights run as they are by the PyTorch runner
(`runtime/engine/torch_runner.py`, the plugins' kernels on CPU or one GPU per rank): no graph, no lowering, no
engine stage. Weights are held in the runner's compute dtype: fp32 on CPU, bf16 on GPUs (`plan/backend_terms.py`)."""

from __future__ import annotations

from moe_export.export.backends.base import Backend

BACKEND = Backend(
    name="torch",
    graph_form=None,
    rank_stage=None,
)

"""Alias of `moe_export.export.convert.checkpoint` (an earlier interface path)."""

from moe_export.export.convert.checkpoint import CheckpointReader, load_model, open_checkpoint

__all__ = ["CheckpointReader", "load_model", "open_checkpoint"]

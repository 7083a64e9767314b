"""Alias of `moe_export.export.convert.synth` (an earlier interface path)."""

from moe_export.export.convert.synth import PRESETS, write_synthetic_checkpoint, write_synthetic_tokenizer

__all__ = ["PRESETS", "write_synthetic_checkpoint", "write_synthetic_tokenizer"]

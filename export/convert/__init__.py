"""The convert stage's side of a build: checkpoint reading and validation (`checkpoint`, `census`), synthetic
checkpoints (`synth`), weight transforms (`transforms`) and one rank's conversion (`rank`). `convert_rank` here is
the alias of `rank.convert_rank`."""

from moe_export.export.convert.rank import convert_rank

__all__ = ["convert_rank"]

"""The source checkpoint of a build: where it is, what it is, and what the build copies from it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_export.common.atomic import sha256_file
from moe_export.common.model_config import GENERATION_CONFIG
from moe_export.common.recipe import Recipe
from moe_export.export.build.stage_keys import source_identity

LICENSE = "LICENSE"
LICENSE_NAMES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "license", "license.txt")
# Files copied verbatim from the source next to the engine (the "tokenizer" stage): what a runtime needs
# besides the weights (tokenizer, chat template, and the generation config with its stop ids).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", GENERATION_CONFIG, "preprocessor_config.json")
SYNTH_SEED = 0
SYNTH_TEMP_RE = re.compile(r"^\..+\.(synth|old)-\d+$")


@dataclass
class Source:
    """The checkpoint a build reads: where it is, what it is, and its identity (`stage_keys`)."""

    path: Path
    kind: str  # "checkpoint" or "synthetic"
    spec: str  # recipe model.source as given
    preset: str | None = None
    seed: int | None = None
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes: config.json, the index, every shard
    config_sha256: str = ""
    layout_sha256: str = ""  # CheckpointReader.layout_digest()
    reads: dict[int, str] = field(default_factory=dict)  # rank -> digest of the bytes its convert stage read
    license_file: str | None = None
    license_sha256: str | None = None
    tokenizer_files: dict[str, str] = field(default_factory=dict)  # name -> sha256, of TOKENIZER_FILES present

    def identity(self) -> str:
        """What is known of the source before its tensor data is read (location-independent)."""
        return source_identity(self.config_sha256, self.layout_sha256)

    def manifest_entry(self) -> dict:
        entry: dict[str, Any] = {
            "kind": self.kind,
            "files": {n: {"size": size} for n, size in self.files.items()},
            "config_sha256": self.config_sha256,
            "layout_sha256": self.layout_sha256,
            "reads_sha256": {f"rank{n}": d for n, d in sorted(self.reads.items())},
        }
        if self.kind == "synthetic":
            entry.update(preset=self.preset, seed=self.seed)
        else:
            entry["path"] = self.spec
        return entry


def source_location(recipe: Recipe, out: Path) -> tuple[str, Path, str | None]:
    src = recipe.model.source
    if src.startswith("synthetic:"):
        preset = src.split(":", 1)[1]
        return "synthetic", out / ".cache" / f"source-{preset}-seed{SYNTH_SEED}", preset
    return "checkpoint", Path(src).expanduser(), None


def identify_extras(src: Source) -> None:
    """Process 0: the sha256 of the LICENSE and tokenizer files the global stages copy."""
    for name in LICENSE_NAMES:
        if (src.path / name).is_file():
            src.license_file, src.license_sha256 = name, sha256_file(src.path / name)
            break
    src.tokenizer_files = {n: sha256_file(src.path / n) for n in TOKENIZER_FILES if (src.path / n).is_file()}


def vision_stamps(reader) -> dict[str, list[int]] | None:
    """(size, mtime_ns) of each shard holding tower tensors; None without a tower."""
    specs = reader.vision_specs()
    if not specs:
        return None
    files = sorted({reader.stored(s.name).file for s in specs if s.name in reader})
    stamps = {}
    for f in files:
        st = (reader.path / f).stat()
        stamps[f] = [st.st_size, st.st_mtime_ns]
    return stamps

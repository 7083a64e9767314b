"""`EngineConfig`: the one reader and writer of an engine directory's `config.json`.

The build writes it (`EngineConfig.write`); every runner and entry point reads it (`EngineConfig.read`), so
each field has one meaning and one default (none: a missing or mistyped field is an InputError naming it).
The file holds the recipe the engine was built from and, for readers of the JSON, copies of its target,
quantization, attention, limits, thinking, backend and mapping and its fingerprint; the copies must equal the
recipe's (edit the recipe and rebuild).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from moe_export.common.atomic import atomic_write_json
from moe_export.common.errors import InputError
from moe_export.common.mapping import Mapping
from moe_export.common.model_config import ModelConfig
from moe_export.common.pools import EngineMemory
from moe_export.common.recipe import LimitsSection, Recipe
from pydantic import ValidationError

CONFIG = "config.json"
PLUGIN_DOMAIN = "moe_export"  # ONNX domain of our plugin ops = TensorRT plugin namespace
ENGINE_FORMAT = "moe-export-engine/1"
RECIPE_ECHOES = ("target", "quantization", "attention", "limits", "thinking")


@dataclass(frozen=True)
class EngineConfig:
    """An engine's config.json. recipe: the validated recipe the engine was built from (limits, thinking,
    backend and mapping come from it); pretrained_config: the checkpoint's HF config (`model` parses it);
    ranks: each rank's mapping (`Mapping.to_dict`); files: artifact name patterns; weight_classes: tensor name ->
    weight class; memory: what each rank's pools may take (`pools.EngineMemory`)."""

    moe_export_version: str
    architecture: str
    model_type: str
    pretrained_config: dict[str, Any]
    ranks: tuple[dict[str, Any], ...]
    eos_token_ids: tuple[int, ...]
    plugin_domain: str
    files: dict[str, str]
    recipe: Recipe
    weight_classes: dict[str, str]
    memory: EngineMemory

    @classmethod
    def from_recipe(cls, recipe: Recipe, model: ModelConfig, *, version: str, files: dict[str, str],
                    weight_classes: dict[str, str], memory: EngineMemory) -> EngineConfig:
        """The config of an engine built from `recipe` over a checkpoint whose config is `model`."""
        return cls(moe_export_version=version, architecture=model.architecture, model_type=model.model_type,
                   pretrained_config=model.raw,
                   ranks=tuple(Mapping.from_recipe(recipe, n).to_dict() for n in range(recipe.target.world_size)),
                   eos_token_ids=tuple(model.eos_token_ids), plugin_domain=PLUGIN_DOMAIN, files=files, recipe=recipe,
                   weight_classes=weight_classes, memory=memory)

    @property
    def backend(self) -> str:
        return self.recipe.backend

    @property
    def mapping(self) -> Mapping:
        """The engine's layout, as rank 0's place in it (`rank_mapping` for another rank's)."""
        return self.rank_mapping(0)

    def rank_mapping(self, rank: int) -> Mapping:
        return Mapping.from_recipe(self.recipe, rank)

    @property
    def limits(self) -> LimitsSection:
        return self.recipe.limits

    @property
    def thinking(self) -> dict[str, int]:
        """Reasoning-token caps per tier (low / high / max)."""
        return self.recipe.thinking.model_dump()

    @property
    def name(self) -> str:
        return self.recipe.name

    @cached_property
    def model(self) -> ModelConfig:
        """The parsed HF config (checked when the file is read)."""
        return ModelConfig.from_hf_dict(self.pretrained_config, source=f"engine {CONFIG}: pretrained_config")

    def to_dict(self) -> dict[str, Any]:
        dump = self.recipe.model_dump(mode="json")
        return {
            "format": ENGINE_FORMAT,
            "moe_export_version": self.moe_export_version,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "pretrained_config": self.pretrained_config,
            "mapping": self.mapping.layout_dict(),
            "ranks": list(self.ranks),
            "backend": self.backend,
            **{section: dump[section] for section in RECIPE_ECHOES},
            "eos_token_ids": list(self.eos_token_ids),
            "plugin_domain": self.plugin_domain,
            "files": self.files,
            "recipe": dump,
            "recipe_sha256": self.recipe.fingerprint(),
            "weight_classes": self.weight_classes,
            "memory": self.memory.to_dict(),
        }

    def write(self, engine_dir: str | Path) -> None:
        """Write `engine_dir/config.json` atomically."""
        atomic_write_json(Path(engine_dir) / CONFIG, self.to_dict())

    @classmethod
    def read(cls, engine_dir: str | Path) -> EngineConfig:
        """Read and validate `engine_dir/config.json`; InputError naming the file and the field otherwise."""
        path = Path(engine_dir) / CONFIG
        if not path.is_file():
            raise InputError(f"{engine_dir}: not an engine directory (no {CONFIG}); build one with moe-export build")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = CONFIG) -> EngineConfig:
        """Validate a config.json object: every field present with its type, the echoes equal to the recipe."""
        if not isinstance(data, dict):
            raise InputError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {"format", "mapping", "backend", "recipe_sha256", *RECIPE_ECHOES, *cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}")
        fmt = _get(data, "format", str, source)
        if fmt != ENGINE_FORMAT:
            raise InputError(f"{source}: field 'format' is {fmt!r}; this moe-export reads {ENGINE_FORMAT!r} "
                             "(rebuild the engine)")
        try:
            recipe = Recipe.model_validate(_get(data, "recipe", dict, source))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InputError(f"{source}: field 'recipe{'.' + where if where else ''}': {err['msg']}") from None
        ranks = _get(data, "ranks", list, source)
        eos = _get(data, "eos_token_ids", list, source)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise InputError(f"{source}: field 'eos_token_ids' must be a list of token ids, got {json.dumps(eos)[:80]}")
        files = _get(data, "files", dict, source)
        classes = _get(data, "weight_classes", dict, source)
        for field, table in (("files", files), ("weight_classes", classes)):
            if not all(isinstance(v, str) for v in table.values()):
                raise InputError(f"{source}: field {field!r} must map names to strings")
        cfg = cls(
            moe_export_version=_get(data, "moe_export_version", str, source),
            architecture=_get(data, "architecture", str, source),
            model_type=_get(data, "model_type", str, source),
            pretrained_config=_get(data, "pretrained_config", dict, source),
            ranks=tuple(ranks),
            eos_token_ids=tuple(eos),
            plugin_domain=_get(data, "plugin_domain", str, source),
            files=files,
            recipe=recipe,
            weight_classes=classes,
            memory=EngineMemory.from_dict(_get(data, "memory", dict, source), source),
        )
        if len(ranks) != recipe.target.world_size or not all(isinstance(r, dict) for r in ranks):
            raise InputError(f"{source}: field 'ranks' must hold one mapping object per rank "
                             f"({recipe.target.world_size}), got {json.dumps(ranks)[:80]}")
        if len(cfg.memory.ranks) != recipe.target.world_size:
            raise InputError(f"{source}: field 'memory.ranks' must hold one pool budget per rank "
                             f"({recipe.target.world_size}), got {len(cfg.memory.ranks)}")
        written = cfg.to_dict()
        for field in ("mapping", "backend", "recipe_sha256", *RECIPE_ECHOES):
            if _get(data, field, object, source) != written[field]:
                raise InputError(f"{source}: field {field!r} disagrees with the recipe it was built from "
                                 f"({json.dumps(data[field])[:80]} vs {json.dumps(written[field])[:80]}): "
                                 "edit the recipe and rebuild rather than config.json")
        try:
            cfg.model  # noqa: B018 - parse (and check) the HF config once, here
        except InputError as exc:
            raise InputError(f"{source}: field 'pretrained_config': {exc}") from None
        return cfg


def is_engine_config(engine_dir: str | Path) -> bool:
    """Whether `engine_dir/config.json` is an engine's (a moe-export format tag) rather than a checkpoint's HF
    config; says nothing of its validity (`EngineConfig.read` checks that)."""
    try:
        data = json.loads((Path(engine_dir) / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith("moe-export-engine/")


_TYPE_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "a list", object: "a value"}


def _get(data: dict, key: str, kind: type, source: str, prefix: str = "") -> Any:
    if key not in data:
        raise InputError(f"{source}: missing field '{prefix}{key}'")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"{source}: field '{prefix}{key}' must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:80]}")
    return value

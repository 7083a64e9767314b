"""Content keys of the build stages: what each stage's output depends on, hashed.

A key is sha256 over the stage name, the recipe fields in `STAGE_FIELDS`, what the stage reads of the
source, the upstream stages' identities, and the stage's code: the sha256 of every source file in
`STAGE_CODE` (so editing the converter, the exporter or a plugin reruns exactly the stages that run it)
and the versions of the libraries in `STAGE_LIBRARIES` that shape its output. A stage whose key is
unchanged is not rerun.

The source enters in two ways. `source_id` (`source_identity`) is cheap, known before anything is
converted: config.json's sha256 and the shard headers' tensor table (`CheckpointReader.layout_digest`).
The tensor bytes enter through the convert stage: its key covers `source_id`, and its identity
(`convert_identity`) adds the digest of the bytes the rank read, hashed as they were converted
(`export.build.source_reads`). The graph and backend stages of a rank are keyed by that identity, `config` by
every rank's. So a rank's downstream keys are known only once its convert stage is resolved (run, or
found up to date by `source_reads.check`).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from moe_export.common.atomic import canonical_json
from moe_export.common.manifest import library_versions
from moe_export.common.mapping import Mapping
from moe_export.common.model_config import GENERATION_CONFIG
from moe_export.common.recipe import Recipe
from moe_export.export.backends import all_backends, backend_for
from moe_export.export.plan.planner import bytes_per_checkpoint

# Recipe fields (dotted paths into the recipe) each stage's output depends on, beyond its upstream keys; the
# stages a backend adds (`export/backends/`) declare theirs.
_COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "convert": ("quantization", "parallel", "target.gpu", "target.nodes", "target.gpus_per_node", "backend"),
    "graph": ("attention", "limits"),
    "vision": ("vision",),
}
_MODEL_CODE = (("common", "model_config.py"), ("common", "mapping.py"), ("graphs", "sharding.py"), ("graphs", "weights.py"))
# Source files each stage runs, as (subpackage of moe_export, glob inside it).
_COMMON_CODE: dict[str, tuple[tuple[str, str], ...]] = {
    "convert": (("export", "convert/rank.py"), ("export", "convert/checkpoint.py"), ("export", "convert/transforms.py"),
                ("quantize", "*.py"), ("plugins", "moe_mxfp4/layout.py"), *_MODEL_CODE),
    # a backend's own graph form (its pool lowering) shapes the graph too
    "graph": (("graphs", "onnx_*.py"), ("graphs", "fp8_rows.py"), ("graphs", "vision.py"), ("plugins", "*.py"),
              ("plugins", "*/onnx_schema.py"), ("plugins", "*/sizes.py"), ("export", "backends/*/graph_form.py"),
              *_MODEL_CODE),
    "config": (("export", "build/*.py"), ("export", "plan/planner.py"), ("export", "plan/memory.py"),
               ("export", "plan/backend_terms.py"), ("common", "manifest.py"), ("common", "engine_config.py"),
               ("common", "pools.py"), *_MODEL_CODE),
    "vision": (("graphs", "vision.py"), ("graphs", "vision_export.py"), ("graphs", "onnx_*.py"), *_MODEL_CODE),
}
# Distributions whose version shapes each stage's output.
_COMMON_LIBRARIES: dict[str, tuple[str, ...]] = {
    "convert": ("torch", "safetensors", "numpy"),
    "graph": ("onnx", "numpy"),
    "config": ("safetensors",),
    "vision": ("onnx", "torch", "safetensors", "numpy"),
}
_BACKEND_STAGES = {stage.name: stage for backend in all_backends() for stage in backend.stages}
STAGE_FIELDS = {**_COMMON_FIELDS, **{name: st.fields for name, st in _BACKEND_STAGES.items()}}
STAGE_CODE = {**_COMMON_CODE, **{name: st.code for name, st in _BACKEND_STAGES.items()}}
STAGE_LIBRARIES = {**_COMMON_LIBRARIES, **{name: st.libraries for name, st in _BACKEND_STAGES.items()}}


def code_roots() -> dict[str, Path]:
    """Folder of each moe_export subpackage named in STAGE_CODE."""
    roots = {}
    for sub in sorted({sub for globs in STAGE_CODE.values() for sub, _ in globs}):
        spec = importlib.util.find_spec(f"moe_export.{sub}")
        roots[sub] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def code_fingerprint(stage: str, roots: dict[str, Path]) -> dict[str, Any]:
    """sha256 over the stage's source files (relative path + content) and its libraries' versions."""
    h = hashlib.sha256()
    for sub, pattern in STAGE_CODE[stage]:
        for path in sorted(roots[sub].glob(pattern)):
            if path.is_file():
                h.update(f"{sub}/{path.relative_to(roots[sub]).as_posix()}\0".encode())
                h.update(hashlib.sha256(path.read_bytes()).digest())
    return {"sources": h.hexdigest(), "libraries": library_versions(STAGE_LIBRARIES[stage])}


def _pick(dump: dict, dotted: str) -> Any:
    cur: Any = dump
    for part in dotted.split("."):
        cur = cur[part]
    return cur


def _key(stage: str, fields: dict, upstream: list[str], code: dict | None, extra: dict | None = None) -> str:
    payload = {"stage": stage, "recipe": fields, "upstream": upstream, "code": code, **(extra or {})}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def rank_stage_names(recipe: Recipe) -> tuple[str, ...]:
    """A rank's stages in build order (the recipe's backend decides those after convert)."""
    return backend_for(recipe).rank_stage_names


def source_identity(config_sha256: str, layout_sha256: str) -> str:
    """The source as known before any tensor data is read: config.json and the shard headers' tensor table."""
    return hashlib.sha256(canonical_json({"config": config_sha256, "layout": layout_sha256})).hexdigest()


def code_fingerprints() -> dict[str, dict[str, Any]]:
    """`code_fingerprint` of every stage in STAGE_CODE."""
    roots = code_roots()
    return {stage: code_fingerprint(stage, roots) for stage in STAGE_CODE}


def _fields(recipe: Recipe, stage: str) -> dict:
    """The recipe fields a stage's key covers (`STAGE_FIELDS`). `limits.checkpoints_per_slot` (the prefix cache's
    checkpoint pool, which the runners allocate as config.json says) is left out of the graph's (a graph's pools have
    symbolic sizes) and, where the checkpoints take none of the memory the pools are planned in (a GPU target:
    pinned host memory, `bytes_per_checkpoint`), of every stage's: the planner's pool sizes, which a TensorRT engine
    records, do not depend on it there."""
    dump = recipe.model_dump(mode="json")
    if stage == "graph" or not bytes_per_checkpoint(recipe, 1):
        del dump["limits"]["checkpoints_per_slot"]
    return {f: _pick(dump, f) for f in STAGE_FIELDS[stage]}


def convert_key(recipe: Recipe, source_id: str, rank: int, code: dict) -> str:
    """Key of convert/rank{rank}: recipe fields, code, the rank's mapping and the source layout."""
    return _key("convert", _fields(recipe, "convert"), [], code["convert"],
                {"source": source_id, "mapping": Mapping.from_recipe(recipe, rank).to_dict()})


def convert_identity(key: str, reads_digest: str) -> str:
    """What a finished convert stage's output depends on: its key and the digest of the bytes it read."""
    return hashlib.sha256(f"{key}\0{reads_digest}".encode()).hexdigest()


def rank_keys(recipe: Recipe, rank: int, identity: str, code: dict) -> dict[str, str]:
    """Keys of the stages of `rank` after convert (each keyed by its upstream's), given its convert identity."""
    keys, upstream = {}, identity
    for stage in rank_stage_names(recipe)[1:]:
        upstream = keys[f"{stage}/rank{rank}"] = _key(stage, _fields(recipe, stage), [upstream], code[stage])
    return keys


def vision_key(recipe: Recipe, source_id: str, vision_stamps: dict[str, list[int]], code: dict) -> str:
    """Key of the vision stage (K3's tower graph): the recipe's vision section, config.json and the shard
    headers (`source_id`), and the (size, mtime_ns) stamp of each shard holding tower tensors."""
    return _key("vision", _fields(recipe, "vision"), [], code["vision"], {"source": source_id, "shards": vision_stamps})


def tower_key(recipe: Recipe, stage: str, vision: str, code: dict) -> str:
    """Key of a backend's tower stage (tensorrt: `vision_engine`, the tower graph built into `vision.engine`):
    the vision stage's key and the recipe fields the stage declares (tensorrt: what the profile and the memory
    budget come from: images per request, the patch limit or the reserve it is derived from, target, tp)."""
    return _key(stage, _fields(recipe, stage), [vision], code[stage])


def global_keys(recipe: Recipe, source_id: str, identities: list[str], license_sha256: str | None,
                tokenizer_files: dict[str, str], code: dict) -> dict[str, str]:
    """Keys of config (the whole recipe, config.json, every rank's convert identity: the class map reads the
    weights, and generation_config.json: its stop ids), license and tokenizer."""
    return {
        "config": _key("config", recipe.model_dump(mode="json"), identities, code["config"],
                       {"source": source_id, "generation_config": tokenizer_files.get(GENERATION_CONFIG)}),
        "license": _key("license", {}, [], None, {"source": license_sha256 or "none"}),
        "tokenizer": _key("tokenizer", {}, [], None,
                          {"source": hashlib.sha256(canonical_json(tokenizer_files)).hexdigest()}),
    }

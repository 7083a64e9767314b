"""Content keys of the build stages: what each stage's output depends on, hashed.

A key is sha256 over the stage name, the recipe fields in `STAGE_FIELDS`, the source fingerprint, the
upstream stage keys, and the stage's code: the sha256 of every source file in `STAGE_CODE` (so editing
the converter, the exporter or a plugin reruns exactly the stages that run it) and the versions of the
libraries in `STAGE_LIBRARIES` that shape its output. A stage whose key is unchanged is not rerun.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from moe_export.export.atomic import canonical_json
from moe_export.graphs.config import GENERATION_CONFIG
from moe_export.graphs.sharding import Mapping
from moe_export.recipes.schema import Recipe

# Recipe fields (dotted paths into the recipe) each stage's output depends on, beyond its upstream keys.
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "convert": ("quantization", "parallel", "target.gpu", "target.nodes", "target.gpus_per_node"),
    "graph": ("attention", "limits"),
    "lower": (),
    "engine": ("limits", "target", "workspace_reserve_gib"),
}
_MODEL_CODE = (("graphs", "config.py"), ("graphs", "sharding.py"), ("graphs", "weights.py"))
# Source files each stage runs, as (subpackage of moe_export, glob inside it).
STAGE_CODE: dict[str, tuple[tuple[str, str], ...]] = {
    "convert": (("export", "convert.py"), ("export", "checkpoint.py"), ("quantize", "*.py"), *_MODEL_CODE),
    "graph": (("graphs", "onnx_export.py"), ("plugins", "*.py"), ("plugins", "*/onnx_schema.py"), *_MODEL_CODE),
    "lower": (("export", "backends.py"), ("plugins", "*.py"), ("plugins", "*/onnx_schema.py"), ("plugins", "*/ort.py")),
    "engine": (("export", "backends.py"), ("plugins", "**/*.py")),
    "config": (("export", "build.py"), ("export", "manifest.py"), *_MODEL_CODE),
}
# Distributions whose version shapes each stage's output.
STAGE_LIBRARIES: dict[str, tuple[str, ...]] = {
    "convert": ("torch", "safetensors", "numpy"),
    "graph": ("onnx", "numpy"),
    "lower": ("onnx", "onnxruntime", "onnx-ir", "numpy"),
    "engine": ("onnx", "tensorrt", "numpy"),
    "config": ("safetensors",),
}


def code_roots() -> dict[str, Path]:
    """Folder of each moe_export subpackage named in STAGE_CODE."""
    roots = {}
    for sub in sorted({sub for globs in STAGE_CODE.values() for sub, _ in globs}):
        spec = importlib.util.find_spec(f"moe_export.{sub}")
        roots[sub] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each distribution in `names` ("not installed" when absent)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


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


def _key(stage: str, fields: dict, source_fp: str, upstream: list[str], code: dict | None, extra: dict | None = None) -> str:
    payload = {"stage": stage, "recipe": fields, "source": source_fp, "upstream": upstream, "code": code,
               **(extra or {})}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def rank_mapping(recipe: Recipe, rank: int) -> Mapping:
    p = recipe.parallel
    return Mapping(recipe.target.world_size, rank, p.tp, p.ep, p.attention == "tp")


def rank_stage_names(recipe: Recipe) -> tuple[str, ...]:
    return ("convert", "graph", "lower" if recipe.backend == "onnxruntime" else "engine")


def stage_keys(
    recipe: Recipe, source_fp: str, license_sha256: str | None, tokenizer_files: dict[str, str]
) -> dict[str, str]:
    """Every stage's content key: "convert/rank0", ..., "config", "license", "tokenizer"."""
    dump = recipe.model_dump(mode="json")
    roots = code_roots()
    code = {stage: code_fingerprint(stage, roots) for stage in STAGE_CODE}

    def fields(stage: str) -> dict:
        return {f: _pick(dump, f) for f in STAGE_FIELDS[stage]}

    keys: dict[str, str] = {}
    last = rank_stage_names(recipe)[-1]
    for n in range(recipe.target.world_size):
        conv = _key("convert", fields("convert"), source_fp, [], code["convert"],
                    {"mapping": rank_mapping(recipe, n).to_dict()})
        graph = _key("graph", fields("graph"), source_fp, [conv], code["graph"])
        keys[f"convert/rank{n}"], keys[f"graph/rank{n}"] = conv, graph
        keys[f"{last}/rank{n}"] = _key(last, fields(last), source_fp, [graph], code[last])
    converts = [keys[f"convert/rank{n}"] for n in range(recipe.target.world_size)]
    keys["config"] = _key("config", dump, source_fp, converts, code["config"],
                          {"generation_config": tokenizer_files.get(GENERATION_CONFIG)})
    keys["license"] = _key("license", {}, license_sha256 or "none", [], None)
    keys["tokenizer"] = _key("tokenizer", {}, hashlib.sha256(canonical_json(tokenizer_files)).hexdigest(), [], None)
    return keys

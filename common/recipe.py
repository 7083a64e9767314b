"""The build recipe: a validated YAML document describing model, target cluster, parallelism,
quantization, attention, limits and thinking budgets.

Loading is strict: unknown keys and bad values are refused with `file:line` and the field path.
`--recipe NAME.yaml` also resolves against the shipped recipes folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Literal

import yaml
from moe_export.common.errors import InputError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SEQ_LEN_LIMIT = 1048576
MAX_CHECKPOINTS_PER_SLOT = 4096  # a sanity bound (a 1M-token prompt at an 8k-token interval wants 128); memory decides


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    """Where the weights come from: an HF checkpoint directory or `synthetic:PRESET`."""

    source: str = Field(description="checkpoint directory, or synthetic:PRESET")
    config: str | None = Field(
        default=None,
        description="shipped model config (recipes/models/NAME.json) used by `plan` when the checkpoint is absent",
    )


class TargetSection(_Strict):
    gpu: Literal["h100", "h200", "b200", "cpu"]
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1, description="GPUs (or CPU ranks) per node")
    memory_gib: float | None = Field(default=None, gt=0, description="per-rank memory; defaults by gpu kind")
    host_memory_gib: float | None = Field(
        default=None, gt=0, description="host memory of one node (GPU targets): the planner refuses a run whose ranks' "
        "pinned prefix-cache checkpoints and plan-loading buffers need more; null: reported, not checked")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @model_validator(mode="after")
    def _host_memory_beside_gpus(self) -> TargetSection:
        if self.gpu == "cpu" and self.host_memory_gib is not None:
            raise ValueError("host_memory_gib is for GPU targets: a CPU target's ranks are planned in target.memory_gib "
                             "(their checkpoints included)")
        return self


GPU_MEMORY_GIB = {"h100": 80.0, "h200": 141.0, "b200": 180.0}


class ParallelSection(_Strict):
    tp: int = Field(default=1, ge=1, description="tensor parallel size for attention, dense and shared FFNs")
    ep: int = Field(default=1, ge=1, description="expert parallel size: routed experts split in ep slices")
    attention: Literal["tp", "dp"] = Field(
        default="tp", description="tp: every rank runs the same batch, expert partial sums all-reduced; dp: "
        "world/tp attention groups with their own requests (tp inside each), ep = world, all-to-all expert dispatch"
    )


class QuantizationSection(_Strict):
    routed_experts: Literal["mxfp4"] = "mxfp4"
    dense: Literal["bf16", "fp8"] = "bf16"
    attention: Literal["bf16", "fp8"] = "bf16"
    shared_experts: Literal["bf16", "fp8"] = "bf16"
    kv_cache: Literal["bf16", "fp8", "fp32"] = Field(
        default="bf16", description="cache pool storage (compute stays fp32); fp32 for exact parity checks")
    allow_nonfinite: bool = False


class AttentionSection(_Strict):
    sparse_topk: int | None = Field(default=None, ge=1, description="override the model's index_topk")
    indexer: Literal["auto", "none"] = "auto"


class LimitsSection(_Strict):
    max_batch: int = Field(default=8, ge=1)
    max_seq_len: int = Field(default=4096, ge=1, le=MAX_SEQ_LEN_LIMIT)
    max_num_tokens: int = Field(default=8192, ge=1, description="tokens per engine step (prefill chunks + decode)")
    block_size: int = Field(default=64, ge=1, le=4096, description="tokens per paged cache block (MLA latent, DSA keys)")
    max_images_per_request: int = Field(default=4, ge=0, description="image parts one request may carry (K3)")
    max_image_patches: int | None = Field(
        default=None, ge=4, description="patch limit per image, lowering the checkpoint's in_patch_limit (K3: 65536); "
        "null: the largest whose tower activations fit in the workspace reserve")
    checkpoints_per_slot: int = Field(
        default=16, ge=0, le=MAX_CHECKPOINTS_PER_SLOT,
        description="recurrent-state checkpoints of the prefix cache per sequence slot (0: no prefix caching of "
        "hybrid models); host memory, counted by the planner (in the rank's memory on a CPU target)")


class VisionSection(_Strict):
    rms_norm_eps: Literal["float32", "bfloat16"] = Field(
        default="float32", description="the tower's eps-less RMSNorm: float32's epsilon (current PyTorch) or "
        "bfloat16's (2^-7, PyTorch before PR #142848)")


class TensorRTSection(_Strict):
    """Builder options of the TensorRT backend."""

    prefer_aot: bool = Field(default=False, description="plugins with both implementations use their AOT kernel "
                             "(no Python in the engine for them) instead of the JIT one")


class ThinkingSection(_Strict):
    """Reasoning-token caps for the low / high / max thinking budgets."""

    low: int = Field(default=1024, ge=0)
    high: int = Field(default=8192, ge=0)
    max: int = Field(default=32768, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> ThinkingSection:
        if not self.low <= self.high <= self.max:
            raise ValueError(f"budgets must satisfy low <= high <= max, got {self.low}, {self.high}, {self.max}")
        return self


class Recipe(_Strict):
    name: str
    model: ModelSection
    target: TargetSection
    parallel: ParallelSection = ParallelSection()
    quantization: QuantizationSection = QuantizationSection()
    attention: AttentionSection = AttentionSection()
    limits: LimitsSection = LimitsSection()
    thinking: ThinkingSection = ThinkingSection()
    vision: VisionSection = VisionSection()
    backend: Literal["onnxruntime", "tensorrt", "torch"] = "onnxruntime"  # torch: `runtime/engine/torch_runner.py`
    tensorrt: TensorRTSection = TensorRTSection()
    workspace_reserve_gib: float = Field(default=8.0, ge=0, description="per-rank memory kept for activations/workspace")
    output: str = Field(default="out/engine", description="output directory (relative to the working directory)")

    @model_validator(mode="after")
    def _parallel_fits_world(self) -> Recipe:
        world = self.target.world_size
        for key, val in (("tp", self.parallel.tp), ("ep", self.parallel.ep)):
            if world % val:
                raise ValueError(
                    f"parallel.{key}={val} must divide the world size nodes*gpus_per_node={world}"
                )
        if self.parallel.attention == "dp" and self.parallel.ep != world:
            raise ValueError(f"parallel.attention=dp spreads the experts over every rank: parallel.ep="
                             f"{self.parallel.ep} must equal the world size nodes*gpus_per_node={world}")
        return self

    @property
    def memory_bytes(self) -> int:
        gib = self.target.memory_gib or GPU_MEMORY_GIB.get(self.target.gpu)
        if gib is None:
            raise InputError(f"recipe {self.name}: target.memory_gib is required for gpu 'cpu'")
        return int(gib * 2**30)

    def fingerprint(self) -> str:
        """sha256 of the recipe's canonical JSON form (stable across formatting and key order)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def shipped_dir(sub: str = "") -> Path:
    """The shipped recipes folder (`moe_export.recipes`: `*.yaml`), or its sub-folder `sub` (`models`: HF-style
    model configs), found as package data without importing the package."""
    spec = importlib.util.find_spec("moe_export.recipes")
    assert spec is not None and spec.submodule_search_locations, "moe_export.recipes is not installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve() / sub


def resolve_recipe_path(name: str | Path) -> Path:
    """A path as given, else relative to the shipped recipes folder (`h100x64.yaml` or `recipes/h100x64.yaml`)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (shipped_dir() / p, shipped_dir() / p.name):
        if cand.is_file():
            return cand
    shipped = ", ".join(sorted(x.name for x in shipped_dir().glob("*.yaml")))
    raise InputError(f"recipe {str(name)!r} not found (shipped recipes: {shipped})")


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the YAML node at path `loc` (deepest existing ancestor)."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == key:
                    nxt, line = v, k.start_mark.line + 1
                    break
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def load_recipe(name: str | Path) -> tuple[Recipe, Path]:
    """Parse and validate a recipe file; every problem is reported at once as `file:line: field: message`."""
    path = resolve_recipe_path(name)
    text = path.read_text()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a recipe must be a YAML mapping")
    data.setdefault("name", path.stem)
    try:
        return Recipe.model_validate(data), path
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(x) for x in loc) or "(recipe)"
            line = _line_of(root, loc)
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            elif err["type"] == "missing":
                msg = "required field missing"
            lines.append(f"{path}:{line}: {field}: {msg}")
        raise InputError("invalid recipe:\n" + "\n".join(lines)) from None

"""The build driver: a recipe in, an engine directory out, rebuilding only what changed.

Layout of the engine directory OUT (TensorRT-LLM conventions):

    OUT/config.json                     model HF config, mapping, per-rank mappings, recipe echo, thinking
                                        budgets, limits, tensor -> weight class map
    OUT/rank{N}/weights.safetensors     this rank's sharded / quantized weights
    OUT/rank{N}/quantization.json       per-tensor quantization errors (SQNR, max abs error)
    OUT/rank{N}/model.onnx              the rank's graph; initializers point into weights.safetensors
    OUT/rank{N}/ort_segment_*.onnx ...  ONNX Runtime backend: segments (+ plan) from the lowering
    OUT/rank{N}/rank{N}.engine          TensorRT backend: the serialized engine
    OUT/vision.safetensors, vision.onnx K3's vision tower + projector (bf16 tensors as stored) and its graph,
                                        one copy every rank loads (`graphs.vision_export`)
    OUT/vision.engine                   TensorRT backend, K3: the tower's engine, the one file every rank loads
                                        (`export/tensorrt_vision.py`)
    OUT/LICENSE                         the source checkpoint's license, copied
    OUT/tiktoken.model ...              the source checkpoint's tokenizer files (`TOKENIZER_FILES`), copied
    OUT/manifest.json                   written last: every file's size + sha256, versions, hashes, keys

Bookkeeping (not artifacts): `.build/` holds each stage's outputs from when they are produced until
they are published (moved into OUT), `.state/` one JSON record per finished stage, `.cache/` the
synthesized source (and TensorRT's timing caches).

Stages and their content keys (`stage_keys`). A key is sha256 over the stage name, the recipe fields in
`STAGE_FIELDS`, what the stage depends on of the source, the upstream stages' identities, and the stage's
code: its source files' sha256 and the versions of the libraries that shape its output (`STAGE_CODE`,
`STAGE_LIBRARIES`). A stage whose record carries its current key and whose outputs are intact (same size,
mtime and inode as recorded, staged in `.build/` or already published in OUT) is skipped:

    convert/rankN  source layout (config.json's sha256 + the shard headers' tensor table) + quantization +
                   parallel + target (gpu, world size) + rank mapping; and the source bytes it read (below)
    graph/rankN    convert identity (its key + the digest of the bytes it read) + attention + limits
    lower/rankN    graph key                             (backend onnxruntime)
    engine/rankN   graph key + limits + target + workspace_reserve_gib   (backend tensorrt)
    config         the whole recipe + source layout + every convert identity (the class map reads the
                   weights) + generation_config.json's sha256 (its stop ids go into config.json)
    license        the source LICENSE file's sha256
    tokenizer      the source tokenizer files' sha256 (preprocessor_config.json included)
    vision         the recipe's vision section + source layout + each tower shard's (size, mtime_ns)  (K3)
    vision_engine  vision key + images per request + patch limit + target + workspace_reserve_gib + tp
                   (K3, backend tensorrt)

Source bytes are hashed while they are converted, never in a pass of their own, so a fresh build reads
each byte a rank needs once. Each convert record lists the slices the rank read, their sha256 and each
shard's stamp (device, inode, size, mtime, ctime). A convert stage whose key is unchanged is up to date
when every shard it read has its recorded stamp (nothing is read), or when the shards whose stamp moved
still hold the recorded bytes (only the rank's slices of those shards are re-read and compared); the
exact rule is in `export/source_reads.py`. An unchanged rebuild reads no tensor data (validation still
reads K3's A_log padding).

Crash safety. Every file is written under a temporary name in its final folder and renamed into
place; a stage's record is written only after its outputs are in place. Stage outputs go to
`.build/`; only when every stage has succeeded are they moved into OUT (publish: the manifest is
removed first, the outputs are renamed into place, stale artifacts are removed, the manifest is
written last). So a failed or killed build leaves the previous output untouched, and the next run
resumes from the last recorded stage and ends byte-identical to an uninterrupted build.

One link per file. Publishing renames (a rename keeps size, mtime and inode, so the stage records
still describe the published files), and stages that need an upstream output next to another see it
through a symbolic link in a scratch folder: every file in OUT has exactly one hard link, which
onnx.checker requires of external data ("potential hardlink attack"). Nothing is ever copied except
the small files taken from the source (LICENSE, tokenizer).

One build per output. Process 0 holds an exclusive lock on OUT (`build_lock`, .cache/build.lock) for the whole build; a
second build into the same OUT exits 2 naming the holder instead of sweeping its temporary files.

Parallelism. Under `mpiexec -n R`, MPI process r builds the ranks n with n % R == r; process 0
prepares the source, then writes the global artifacts and the manifest after all ranks finished.
Without an MPI launcher the ranks are built in turn.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_export.common.atomic import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    fsync_path,
    sha256_file,
    sweep_temporaries,
)
from moe_export.common.engine_config import CONFIG, EngineConfig
from moe_export.common.errors import BuildError, InputError
from moe_export.common.manifest import (
    GRAPH,
    MANIFEST,
    MANIFEST_FORMAT,
    WEIGHTS,
    dependency_versions,
    is_engine_dir,
    quantization_summary,
    tool_version,
)
from moe_export.common.model_config import GENERATION_CONFIG
from moe_export.common.mpi import mpi_world
from moe_export.common.recipe import Recipe
from moe_export.export import source_reads
from moe_export.export.build_lock import OutputLock
from moe_export.export.stage_keys import (
    code_fingerprints,
    convert_identity,
    convert_key,
    global_keys,
    rank_keys,
    rank_stage_names,
    source_identity,
    vision_engine_key,
    vision_key,
)
from moe_export.graphs.sharding import Mapping

QUANT_REPORT = "quantization.json"
LICENSE = "LICENSE"
LICENSE_NAMES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "license", "license.txt")
# Files copied verbatim from the source next to the engine (the "tokenizer" stage): what a runtime needs
# besides the weights (tokenizer, chat template, and the generation config with its stop ids).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", GENERATION_CONFIG, "preprocessor_config.json")
SYNTH_SEED = 0
SYNTH_TEMP_RE = re.compile(r"^\..+\.(synth|old)-\d+$")

# ---- stage functions (imported lazily, so a fully up-to-date build imports none of them) ----
def _convert_rank(reader, cfg, recipe, mapping, out_path: Path) -> dict:
    from moe_export.export.convert import convert_rank

    return convert_rank(reader, cfg, recipe, mapping, out_path)


def _export_rank_graph(cfg, recipe, mapping, weights_path: Path, out_path: Path) -> dict:
    from moe_export.graphs.onnx_export import export_rank_graph

    return export_rank_graph(cfg, recipe, mapping, weights_path, out_path)


def _lower_for_onnxruntime(graph_path: Path, out_dir: Path) -> list[str]:
    from moe_export.export.backends import lower_for_onnxruntime

    return lower_for_onnxruntime(graph_path, out_dir)


def _build_tensorrt_engine(graph_path: Path, recipe, mapping, out_path: Path) -> None:
    from moe_export.export.tensorrt_build import build_tensorrt_engine

    build_tensorrt_engine(graph_path, recipe, mapping, out_path)


def _build_tensorrt_vision_engine(graph_path: Path, recipe, cfg, out_path: Path) -> None:
    from moe_export.export.tensorrt_vision import build_vision_engine

    build_vision_engine(graph_path, recipe, cfg, out_path)


@dataclass(frozen=True)
class Stages:
    """The stage functions the driver calls (the defaults are the real ones). `convert_rank` reads the
    source only through the reader it is given: its reads are what identify the source bytes it used."""

    convert_rank: Callable[..., dict] = _convert_rank
    export_rank_graph: Callable[..., dict] = _export_rank_graph
    lower_for_onnxruntime: Callable[..., list[str]] = _lower_for_onnxruntime
    build_tensorrt_engine: Callable[..., None] = _build_tensorrt_engine
    build_tensorrt_vision_engine: Callable[..., None] = _build_tensorrt_vision_engine


@dataclass
class BuildResult:
    out: Path
    ran: list[str] = field(default_factory=list)  # stages executed, e.g. "convert/rank0", "config"
    published: list[str] = field(default_factory=list)  # artifacts moved into OUT
    removed: list[str] = field(default_factory=list)  # stale artifacts removed from OUT
    manifest_written: bool = False
    reporter: bool = True  # False on MPI processes other than 0, which leave the reporting to process 0

    @property
    def up_to_date(self) -> bool:
        return not (self.ran or self.published or self.removed or self.manifest_written)


# ---- MPI ----
class _SerialComm:
    rank, size = 0, 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


class _MpiComm:
    def __init__(self) -> None:
        from mpi4py import MPI

        self._comm = MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def allgather(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)


def detect_comm() -> _SerialComm | _MpiComm:
    """MPI.COMM_WORLD when started by an MPI launcher (mpi4py is imported only then), else a serial stand-in."""
    if mpi_world() is not None:
        return _MpiComm()
    return _SerialComm()


def _collective(comm, fn: Callable[[], Any]) -> Any:
    """Run `fn` on every process, then synchronize: if any process failed, all of them raise."""
    err: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # reported to the peers, then re-raised below
        err = exc
    status = None if err is None else ("input" if isinstance(err, InputError) else "build", str(err))
    statuses = comm.allgather(status)
    if err is not None:
        raise err
    for peer, st in enumerate(statuses):
        if st is not None:
            kind, msg = st
            raise (InputError if kind == "input" else BuildError)(f"MPI process {peer}: {msg}")
    return result


# ---- progress ----
class _Progress:
    """A rich progress bar on stderr for the running stage (bytes written, speed, ETA) when stderr is a
    terminal, and one line per finished stage."""

    def __init__(self, enabled: bool | None, prefix: str = "") -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.prefix = prefix
        self._bars = None
        if self.console.is_terminal if enabled is None else enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bars = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
            )

    def __enter__(self) -> _Progress:
        if self._bars:
            self._bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bars:
            self._bars.stop()

    def note(self, msg: str) -> None:
        """One line on stderr."""
        self.console.print(self.prefix + msg, highlight=False, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def task(self, desc: str, watch: Path, total: int | None = None) -> Iterator[None]:
        """Track a stage by the size of the file (or folder) it is writing."""
        desc = self.prefix + desc
        t0 = time.monotonic()
        stop = threading.Event()
        thread = None
        if self._bars:
            from rich.markup import escape

            bars = self._bars
            tid = bars.add_task(escape(desc), total=total)

            def poll() -> None:
                while not stop.wait(0.25):
                    bars.update(tid, completed=_size_of(watch))

            thread = threading.Thread(target=poll, daemon=True)
            thread.start()
        try:
            yield
        finally:
            if thread is not None:
                stop.set()
                thread.join()
                bars.remove_task(tid)
        self.console.print(f"{desc}: done in {time.monotonic() - t0:.1f} s", highlight=False, markup=False)


def _size_of(path: Path) -> int:
    try:
        if path.is_dir():  # a scratch folder: what the stage wrote, not the inputs linked in for it
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and not p.is_symlink())
        return path.stat().st_size
    except OSError:
        return 0


# ---- the source checkpoint ----
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


def _source_location(recipe: Recipe, out: Path) -> tuple[str, Path, str | None]:
    src = recipe.model.source
    if src.startswith("synthetic:"):
        preset = src.split(":", 1)[1]
        return "synthetic", out / ".cache" / f"source-{preset}-seed{SYNTH_SEED}", preset
    return "checkpoint", Path(src).expanduser(), None


# ---- stage records ----
class _State:
    """`.state/<stage>[-rankN].json` records: key, outputs (size, mtime, inode, sha256) and the stage's result.

    An output is staged at `.build/<rel>` until publish renames it to `OUT/<rel>`; `locate` finds it
    in either place by its recorded size, mtime and inode."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.folder = out / ".state"
        self.build = out / ".build"

    def _path(self, name: str) -> Path:
        return self.folder / (name.replace("/", "-") + ".json")

    def load(self, name: str) -> dict | None:
        try:
            rec = json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def locate(self, rel: str, meta: dict) -> Path | None:
        """The output `rel` as recorded in `meta`: staged in .build, published in OUT, or None if neither
        holds it intact."""
        for path in (self.build / rel, self.out / rel):
            try:
                st = path.stat()
            except OSError:
                continue
            if (st.st_size, st.st_mtime_ns, st.st_ino) == (meta.get("size"), meta.get("mtime_ns"), meta.get("ino")):
                return path
        return None

    def current(self, name: str, key: str) -> dict | None:
        """The record if it has `key` and its outputs are intact, else None."""
        rec = self.load(name)
        if rec is None or rec.get("key") != key or not isinstance(rec.get("outputs"), dict):
            return None
        if any(self.locate(rel, meta) is None for rel, meta in rec["outputs"].items()):
            return None
        return rec

    def output(self, name: str, rel: str) -> Path:
        """Where the output `rel` of the finished stage `name` is now."""
        rec = self.load(name) or {}
        meta = rec.get("outputs", {}).get(rel)
        path = None if meta is None else self.locate(rel, meta)
        if path is None:
            raise BuildError(f"stage {name}: its output {rel} is gone (was the output folder modified meanwhile?)")
        return path

    def write(self, name: str, obj: Any) -> None:
        atomic_write_json(self._path(name), obj)

    def record(self, name: str, key: str, outputs: list[str], result: Any, source: dict | None = None) -> dict:
        """Record a finished stage: its key, its outputs staged in .build, its result and (convert) what it
        read of the source (`source_reads`)."""
        metas = {}
        for rel in outputs:
            path = self.build / rel
            st = path.stat()
            metas[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "sha256": sha256_file(path)}
        rec = {"stage": name, "key": key, "outputs": metas, "result": result}
        if source is not None:
            rec["source"] = source
        self.write(name, rec)
        return rec


# ---- the driver ----
@dataclass
class _Ctx:
    recipe: Recipe
    out: Path
    stages: Stages
    state: _State
    progress: _Progress
    expected_bytes: dict[int, int]
    reader: Any = None
    source: Source | None = None
    code: dict[str, dict] = field(default_factory=dict)  # stage_keys.code_fingerprints()
    keys: dict[str, str] = field(default_factory=dict)  # filled stage by stage: convert keys first


def _check_plan(recipe: Recipe) -> dict[int, int]:
    """The planner's checks (layout divides the model, weights fit) before any work; returns per-rank bytes."""
    from moe_export.export.planner import make_plan

    plan = make_plan(recipe)
    if not plan.fits:
        raise InputError(f"recipe {recipe.name}: {plan.verdict()}")
    return {r.rank: r.weight_bytes["total"] for r in plan.per_rank}


def _check_backend(recipe: Recipe, stages: Stages) -> None:
    """The TensorRT backend needs TensorRT: say so before hours of conversion, not after."""
    import importlib.util

    if (recipe.backend == "tensorrt" and stages.build_tensorrt_engine is _build_tensorrt_engine
            and importlib.util.find_spec("tensorrt") is None):
        raise InputError(
            f"recipe {recipe.name}: backend 'tensorrt' needs the TensorRT Python package, which is not installed; "
            "build on a GPU machine with TensorRT >= 10.9, or use backend: onnxruntime"
        )


def _check_output(out: Path) -> None:
    """Refuse an output path that is a file or a non-empty folder holding something else than a build."""
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (
            (out / ".state").is_dir() or (out / ".cache").is_dir() or is_engine_dir(out)):
        raise InputError(
            f"output {out}: directory is not empty and holds no moe-export build; choose an empty or new --out"
        )


def _prepare(ctx: _Ctx) -> None:
    """Process 0: create the folders, sweep leftovers of killed runs, synthesize a synthetic source."""
    out = ctx.out
    try:
        for d in (out, out / ".state", out / ".cache", out / ".build"):
            d.mkdir(parents=True, exist_ok=True)
        probe = out / ".state" / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"output {out}: cannot write there ({exc.strerror or exc})") from None
    sweep_temporaries(out)
    for p in (out / ".cache").iterdir():
        if SYNTH_TEMP_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
    kind, path, preset = _source_location(ctx.recipe, out)
    if kind == "synthetic" and not path.is_dir():
        from moe_export.export.synth import write_synthetic_checkpoint

        write_synthetic_checkpoint(preset, path, seed=SYNTH_SEED)


def _open_source(ctx: _Ctx) -> None:
    """Open and validate the source, identify it from config.json and the shard headers (no tensor data is
    read), and compute every convert key."""
    from moe_export.export.checkpoint import INDEX_FILE, open_checkpoint

    kind, path, preset = _source_location(ctx.recipe, ctx.out)
    if kind == "checkpoint" and not path.is_dir():
        raise InputError(f"recipe {ctx.recipe.name}: model.source {str(path)!r} is not a checkpoint directory")
    ctx.reader = reader = open_checkpoint(path, validate=True)
    src = ctx.source = Source(path, kind, ctx.recipe.model.source, preset, SYNTH_SEED if kind == "synthetic" else None)
    names = [CONFIG] + ([INDEX_FILE] if (path / INDEX_FILE).is_file() else []) + reader.files
    src.files = {name: (path / name).stat().st_size for name in names}
    src.config_sha256, src.layout_sha256 = sha256_file(path / CONFIG), reader.layout_digest()
    ctx.code = code_fingerprints()
    ctx.keys = {f"convert/rank{n}": convert_key(ctx.recipe, src.identity(), n, ctx.code)
                for n in range(ctx.recipe.target.world_size)}


def _identify_extras(src: Source) -> None:
    """Process 0: the sha256 of the LICENSE and tokenizer files the global stages copy."""
    for name in LICENSE_NAMES:
        if (src.path / name).is_file():
            src.license_file, src.license_sha256 = name, sha256_file(src.path / name)
            break
    src.tokenizer_files = {n: sha256_file(src.path / n) for n in TOKENIZER_FILES if (src.path / n).is_file()}


DISK_FULL_ERRNOS = (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)
RUST_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) report errno


def _errno_of(exc: BaseException) -> int | None:
    """The OS error number behind `exc`: an OSError in its chain, or one quoted in its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    m = RUST_OS_ERROR_RE.search(str(exc))
    return int(m.group(1)) if m else None


def _stage_failed(what: str, exc: Exception) -> BuildError:
    hint = ""
    if _errno_of(exc) in DISK_FULL_ERRNOS:
        hint = " (the disk is full or a file size limit was reached; the previous output is untouched)"
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return BuildError(f"{what} failed: {exc.strerror or exc}{where}{hint}")
    return BuildError(f"{what} failed: {type(exc).__name__}: {exc}{hint}")


def _run_convert(ctx: _Ctx, n: int, mapping: Mapping) -> tuple[list[str], Any, dict]:
    """Convert with every source read hashed as it streams through; returns outputs, result and the
    record of what was read (`source_reads`)."""
    rdir = ctx.state.build / f"rank{n}"
    with atomic_path(rdir / WEIGHTS) as tmp, ctx.progress.task(f"convert rank {n}", tmp, ctx.expected_bytes.get(n)):
        report, source = source_reads.record_reads(
            ctx.reader, lambda: ctx.stages.convert_rank(ctx.reader, ctx.reader.config, ctx.recipe, mapping, tmp))
    atomic_write_json(rdir / QUANT_REPORT, report)
    return [f"rank{n}/{WEIGHTS}", f"rank{n}/{QUANT_REPORT}"], {"summary": report.get("summary")}, source


def _run_graph(ctx: _Ctx, n: int, mapping: Mapping) -> tuple[list[str], Any, None]:
    rdir = ctx.state.build / f"rank{n}"
    weights = ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")
    with atomic_path(rdir / GRAPH) as tmp, ctx.progress.task(f"graph rank {n}", tmp):
        summary = ctx.stages.export_rank_graph(ctx.reader.config, ctx.recipe, mapping, weights, tmp)
    return [f"rank{n}/{GRAPH}"], summary, None


@contextlib.contextmanager
def _scratch(rdir: Path, name: str, inputs: dict[str, Path]) -> Iterator[Path]:
    """A temporary folder inside the rank folder (same filesystem, so results can be renamed out) that
    shows each of `inputs` under its name. They are symbolic links: a hard link would give the file a
    second link, and a published one keeps exactly one."""
    tmp = rdir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for link_name, target in inputs.items():
            os.symlink(os.path.abspath(target), tmp / link_name)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into(src: Path, dst: Path) -> None:
    fsync_path(src)
    os.replace(src, dst)


def _run_lower(ctx: _Ctx, n: int, mapping: Mapping) -> tuple[list[str], Any, None]:
    """Lower into a scratch folder that sees the weights under their name, then rename the files out."""
    rdir = ctx.state.build / f"rank{n}"
    graph = ctx.state.output(f"graph/rank{n}", f"rank{n}/{GRAPH}")
    weights = ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")
    with _scratch(rdir, "lower", {WEIGHTS: weights}) as tmp, ctx.progress.task(f"lower rank {n}", tmp):
        names = list(ctx.stages.lower_for_onnxruntime(graph, tmp))
        bad = [x for x in names if Path(x).name != x or x in (WEIGHTS, GRAPH, QUANT_REPORT) or not (tmp / x).is_file()]
        if bad:
            raise BuildError(f"lower rank {n}: the lowering reported unusable file names {bad}")
        for name in names:
            _move_into(tmp / name, rdir / name)
    return [f"rank{n}/{x}" for x in sorted(names)], {"files": sorted(names)}, None


def _run_engine(ctx: _Ctx, n: int, mapping: Mapping) -> tuple[list[str], Any, None]:
    """Build in a scratch folder that shows the graph with its weights next to it (one may be staged, the
    other published); TensorRT's timing cache is kept in .cache/tensorrt between builds."""
    rdir = ctx.state.build / f"rank{n}"
    name = f"rank{n}.engine"
    timing = ctx.out / ".cache" / "tensorrt" / f"rank{n}.timing_cache"
    inputs = {GRAPH: ctx.state.output(f"graph/rank{n}", f"rank{n}/{GRAPH}"),
              WEIGHTS: ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}")}
    with _scratch(rdir, "engine", inputs) as tmp, ctx.progress.task(f"engine rank {n}", tmp):
        if timing.is_file():
            shutil.copyfile(timing, tmp / timing.name)
        ctx.stages.build_tensorrt_engine(tmp / GRAPH, ctx.recipe, mapping, tmp / name)
        if not (tmp / name).is_file():
            raise BuildError(f"engine rank {n}: the engine builder wrote no {name}")
        if (tmp / timing.name).is_file():
            timing.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / timing.name, timing)
        _move_into(tmp / name, rdir / name)
    return [f"rank{n}/{name}"], None, None


RANK_RUNNERS = {"convert": _run_convert, "graph": _run_graph, "lower": _run_lower, "engine": _run_engine}


def _current_convert(ctx: _Ctx, n: int) -> dict | None:
    """The record of convert/rank{n} if its key is current, its outputs are intact and the source still
    holds the bytes it read (`source_reads.check`, which re-reads only shards whose stamp moved)."""
    name = f"convert/rank{n}"
    rec = ctx.state.current(name, ctx.keys[name])
    if rec is None:
        return None
    source = source_reads.check(ctx.reader, rec.get("source"),
                                lambda msg: ctx.progress.note(f"convert rank {n}: {msg}"))
    if source is None:
        return None
    if source is not rec["source"]:
        rec = {**rec, "source": source}
        ctx.state.write(name, rec)
    return rec


def _run_stage(ctx: _Ctx, stage: str, n: int, mapping: Mapping) -> dict:
    name = f"{stage}/rank{n}"
    try:
        outputs, result, source = RANK_RUNNERS[stage](ctx, n, mapping)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise _stage_failed(f"{stage} of rank {n}", exc) from exc
    return ctx.state.record(name, ctx.keys[name], outputs, result, source)


def _build_ranks(ctx: _Ctx, ranks: list[int]) -> tuple[list[str], dict[str, str], dict[int, str]]:
    """Bring every stage of `ranks` up to date. Returns the stages run, the keys of the ranks' graph and
    backend stages (known once the convert stage is resolved) and each rank's reads digest."""
    ran: list[str] = []
    keys: dict[str, str] = {}
    reads: dict[int, str] = {}
    for n in ranks:
        mapping = Mapping.from_recipe(ctx.recipe, n)
        (ctx.state.build / f"rank{n}").mkdir(parents=True, exist_ok=True)
        rec = _current_convert(ctx, n)
        if rec is None:
            rec = _run_stage(ctx, "convert", n, mapping)
            ran.append(f"convert/rank{n}")
        reads[n] = rec["source"]["digest"]
        mine = rank_keys(ctx.recipe, n, convert_identity(rec["key"], reads[n]), ctx.code)
        keys.update(mine)
        ctx.keys.update(mine)
        for stage in rank_stage_names(ctx.recipe)[1:]:
            name = f"{stage}/rank{n}"
            if not ctx.state.current(name, ctx.keys[name]):
                _run_stage(ctx, stage, n, mapping)
                ran.append(name)
    return ran, keys, reads


def weight_class_map(ctx: _Ctx) -> dict[str, str]:
    """Weight class of every tensor name in the ranks' weights files (headers only)."""
    from moe_export.export.checkpoint import read_safetensors_header
    from moe_export.graphs.weights import all_tensor_specs, classify_tensor_name

    cfg = ctx.reader.config
    spec_class = {s.name: s.weight_class for s in all_tensor_specs(cfg, include_experts=False)}
    out: dict[str, str] = {}
    for n in range(ctx.recipe.target.world_size):
        tensors, _ = read_safetensors_header(ctx.state.output(f"convert/rank{n}", f"rank{n}/{WEIGHTS}"))
        for t in tensors:
            if t.name not in out:
                out[t.name] = spec_class.get(t.name) or (
                    "routed_experts" if ".experts." in t.name else classify_tensor_name(t.name)
                )
    return dict(sorted(out.items()))


def engine_config(ctx: _Ctx) -> EngineConfig:
    """The engine's config.json."""
    files = {"rank_dir": "rank{rank}", "weights": WEIGHTS, "graph": GRAPH, "quantization_report": QUANT_REPORT}
    if ctx.recipe.backend == "torch":  # the runner reads the weights; no graph
        del files["graph"]
    if ctx.recipe.backend == "tensorrt":
        files["engine"] = "rank{rank}.engine"
    return EngineConfig.from_recipe(ctx.recipe, ctx.reader.config, version=tool_version(), files=files,
                                    weight_classes=weight_class_map(ctx))


def _build_globals(ctx: _Ctx) -> list[str]:
    ran = []
    src = ctx.source
    if not ctx.state.current("config", ctx.keys["config"]):
        engine_config(ctx).write(ctx.state.build)
        ctx.state.record("config", ctx.keys["config"], [CONFIG], None)
        ran.append("config")
    if not ctx.state.current("license", ctx.keys["license"]):
        outputs = []
        if src.license_file:
            with atomic_path(ctx.state.build / LICENSE) as tmp:
                shutil.copyfile(src.path / src.license_file, tmp)
            outputs = [LICENSE]
        ctx.state.record("license", ctx.keys["license"], outputs, None)
        ran.append("license")
    if not ctx.state.current("tokenizer", ctx.keys["tokenizer"]):
        for name in src.tokenizer_files:
            with atomic_path(ctx.state.build / name) as tmp:
                shutil.copyfile(src.path / name, tmp)
        ctx.state.record("tokenizer", ctx.keys["tokenizer"], sorted(src.tokenizer_files), None)
        ran.append("tokenizer")
    return ran


def _run_vision(ctx: _Ctx) -> list[str]:
    """K3's tower + projector: `vision.safetensors` (the checkpoint's bf16 tensors) and `vision.onnx`, once per
    engine (every rank loads the same replicated tower). Nothing for a model without a tower."""
    from moe_export.graphs.vision import VISION_NORM_EPS, vision_config
    from moe_export.graphs.vision_export import (
        VISION_GRAPH,
        VISION_WEIGHTS,
        export_vision_graph,
        write_vision_weights,
    )

    vc = vision_config(ctx.reader.config)
    if vc is None or ctx.state.current("vision", ctx.keys["vision"]):
        return []
    try:
        with atomic_path(ctx.state.build / VISION_WEIGHTS) as tmp:
            write_vision_weights(ctx.reader, vc, tmp)
        with _scratch(ctx.state.build, "vision", {VISION_WEIGHTS: ctx.state.build / VISION_WEIGHTS}) as tmp:
            summary = export_vision_graph(vc, tmp / VISION_WEIGHTS, tmp / VISION_GRAPH,
                                          VISION_NORM_EPS[ctx.recipe.vision.rms_norm_eps])
            _move_into(tmp / VISION_GRAPH, ctx.state.build / VISION_GRAPH)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise _stage_failed("vision", exc) from exc
    ctx.state.record("vision", ctx.keys["vision"], [VISION_WEIGHTS, VISION_GRAPH], summary)
    return ["vision"]


def _run_vision_engine(ctx: _Ctx) -> list[str]:
    """Backend tensorrt: the tower graph built into `vision.engine`, one file every rank loads
    (`export/tensorrt_vision.py`), in a scratch folder showing the graph next to its weights."""
    from moe_export.export.tensorrt_vision import VISION_ENGINE
    from moe_export.graphs.vision_export import VISION_GRAPH, VISION_WEIGHTS

    if ctx.state.current("vision_engine", ctx.keys["vision_engine"]):
        return []
    inputs = {name: ctx.state.output("vision", name) for name in (VISION_GRAPH, VISION_WEIGHTS)}
    try:
        with _scratch(ctx.state.build, "vision_engine", inputs) as tmp, ctx.progress.task("vision engine", tmp):
            ctx.stages.build_tensorrt_vision_engine(tmp / VISION_GRAPH, ctx.recipe, ctx.reader.config, tmp / VISION_ENGINE)
            if not (tmp / VISION_ENGINE).is_file():
                raise BuildError(f"vision engine: the engine builder wrote no {VISION_ENGINE}")
            _move_into(tmp / VISION_ENGINE, ctx.state.build / VISION_ENGINE)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise _stage_failed("vision engine", exc) from exc
    ctx.state.record("vision_engine", ctx.keys["vision_engine"], [VISION_ENGINE], None)
    return ["vision_engine"]


def _vision_stamps(ctx: _Ctx) -> dict[str, list[int]] | None:
    """(size, mtime_ns) of each shard holding tower tensors; None without a tower."""
    specs = ctx.reader.vision_specs()
    if not specs:
        return None
    files = sorted({ctx.reader.stored(s.name).file for s in specs if s.name in ctx.reader})
    stamps = {}
    for f in files:
        st = (ctx.reader.path / f).stat()
        stamps[f] = [st.st_size, st.st_mtime_ns]
    return stamps


def _stage_names(recipe: Recipe) -> list[str]:
    names = [f"{s}/rank{n}" for n in range(recipe.target.world_size) for s in rank_stage_names(recipe)]
    return names + ["config", "license", "tokenizer"]


def _publish(ctx: _Ctx, outputs: dict[str, dict], result: BuildResult) -> None:
    """Move the stage outputs staged in .build into OUT and remove artifacts of earlier builds that this
    one no longer has. The manifest is removed first, so a half-published folder never has one."""
    out, build = ctx.out, ctx.state.build
    prev = ctx.state.load("publish") or {}
    prev_files = set(prev.get("files", []))
    to_move = [rel for rel in sorted(outputs) if ctx.state.locate(rel, outputs[rel]) == build / rel]
    stale = sorted(rel for rel in prev_files - set(outputs) if (out / rel).exists())
    if not (to_move or stale) and prev.get("complete") and prev_files == set(outputs):
        return
    if to_move or stale:
        (out / MANIFEST).unlink(missing_ok=True)
    ctx.state.write("publish", {"files": sorted(prev_files | set(outputs)), "complete": False})
    for rel in to_move:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(build / rel, out / rel)
    for folder in sorted({(out / rel).parent for rel in to_move}):
        fsync_path(folder)
    for rel in stale:
        (out / rel).unlink(missing_ok=True)
        parent = (out / rel).parent
        if parent != out and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    ctx.state.write("publish", {"files": sorted(outputs), "complete": True})
    result.published, result.removed = to_move, stale


def _empty_build_folder(build: Path) -> None:
    """After publish every current output is in OUT: what is left in .build was superseded (outputs of
    a stage that ran again before the build finished, segments of an abandoned lowering)."""
    for path in build.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def build_manifest(ctx: _Ctx, records: dict[str, dict]) -> dict:
    """The manifest of the current build (deterministic: no times, no local paths of the output)."""
    files = {}
    for rec in records.values():
        for rel, meta in rec["outputs"].items():
            files[rel] = {"size": meta["size"], "sha256": meta["sha256"]}
    reports = {}
    for n in range(ctx.recipe.target.world_size):
        reports[n] = json.loads(ctx.state.output(f"convert/rank{n}", f"rank{n}/{QUANT_REPORT}").read_text())
    src = ctx.source
    lic = (
        {"file": LICENSE, "source_file": src.license_file, "sha256": src.license_sha256}
        if src.license_file
        else {"file": None, "note": "the source checkpoint has no LICENSE file; check the model's terms before "
              "distributing these artifacts"}
    )
    return {
        "format": MANIFEST_FORMAT,
        "tool": "moe-export",
        "versions": dependency_versions(),
        "recipe": {"name": ctx.recipe.name, "sha256": ctx.recipe.fingerprint()},
        "backend": ctx.recipe.backend,
        "source": src.manifest_entry(),
        "license": lic,
        "quantization": quantization_summary(reports),
        "stages": {name: records[name]["key"] for name in sorted(records)},
        "files": dict(sorted(files.items())),
    }


def _finish(ctx: _Ctx, result: BuildResult) -> None:
    """Process 0, after every rank is built: config, LICENSE and tokenizer, publish, manifest last."""
    src = ctx.source
    _identify_extras(src)
    identities = [convert_identity(ctx.keys[f"convert/rank{n}"], src.reads[n])
                  for n in range(ctx.recipe.target.world_size)]
    ctx.keys.update(global_keys(ctx.recipe, src.identity(), identities, src.license_sha256, src.tokenizer_files,
                                ctx.code))
    stamps = _vision_stamps(ctx)
    names = _stage_names(ctx.recipe)
    if stamps is not None:
        ctx.keys["vision"] = vision_key(ctx.recipe, src.identity(), stamps, ctx.code)
        names.append("vision")
    tower_engine = stamps is not None and ctx.recipe.backend == "tensorrt"
    if tower_engine:
        ctx.keys["vision_engine"] = vision_engine_key(ctx.recipe, ctx.keys["vision"], ctx.code)
        names.append("vision_engine")
    result.ran += _build_globals(ctx) + _run_vision(ctx) + (_run_vision_engine(ctx) if tower_engine else [])
    records = {}
    for name in names:
        rec = ctx.state.current(name, ctx.keys[name])
        if rec is None:
            raise BuildError(f"stage {name} has no current record after the build (was .build/ modified meanwhile?)")
        records[name] = rec
    outputs = {rel: meta for rec in records.values() for rel, meta in rec["outputs"].items()}
    _publish(ctx, outputs, result)
    _empty_build_folder(ctx.state.build)
    data = canonical_json(build_manifest(ctx, records))
    mpath = ctx.out / MANIFEST
    if not (mpath.is_file() and mpath.read_bytes() == data):
        atomic_write_bytes(mpath, data)
        result.manifest_written = True


def build(
    recipe: Recipe,
    out: str | Path | None = None,
    *,
    stages: Stages | None = None,
    comm=None,
    progress: bool | None = None,
) -> BuildResult:
    """Build (or bring up to date) the engine directory for `recipe` at `out` (default recipe.output).

    Returns what this call did; on MPI process 0 `ran` lists the stages run by every process.
    Raises InputError for bad input (before anything is written to the output) and BuildError when a
    stage fails; in both cases the previous output stays as it was.
    """
    comm = comm or detect_comm()
    stages = stages or Stages()
    out = Path(recipe.output if out is None else out).expanduser()
    expected = _check_plan(recipe)
    _check_backend(recipe, stages)
    _check_output(out)
    prefix = f"[mpi {comm.rank}/{comm.size}] " if comm.size > 1 else ""
    ctx = _Ctx(recipe, out, stages, _State(out), _Progress(progress, prefix), expected)
    result = BuildResult(out, reporter=comm.rank == 0)
    lock = _collective(comm, lambda: OutputLock.acquire(out) if comm.rank == 0 else None)
    try:
        _collective(comm, lambda: _prepare(ctx) if comm.rank == 0 else None)
        _collective(comm, lambda: _open_source(ctx))
        mine = [n for n in range(recipe.target.world_size) if n % comm.size == comm.rank]
        with ctx.progress:
            done = _collective(comm, lambda: _build_ranks(ctx, mine))
        ran = []
        for part_ran, part_keys, part_reads in comm.allgather(done):
            ran += part_ran
            ctx.keys.update(part_keys)
            ctx.source.reads.update(part_reads)
        result.ran = sorted(ran, key=_stage_names(recipe).index)
        _collective(comm, lambda: _finish(ctx, result) if comm.rank == 0 else None)
    finally:
        if ctx.reader is not None:
            ctx.reader.close()
        if lock is not None:
            lock.release()
    return result


def describe(result: BuildResult) -> str:
    """One line for the console."""
    if result.up_to_date:
        return f"up to date: nothing to do ({result.out})"
    parts = []
    if result.ran:
        counts: dict[str, int] = {}
        for name in result.ran:
            stage = name.split("/")[0]
            counts[stage] = counts.get(stage, 0) + 1
        parts.append("ran " + ", ".join(f"{s} x{c}" if c > 1 else s for s, c in counts.items()))
    if result.published or result.removed:
        parts.append(f"published {len(result.published)} file(s)" + (f", removed {len(result.removed)}" if result.removed else ""))
    if result.manifest_written:
        parts.append(f"wrote {result.out / MANIFEST}")
    return "; ".join(parts)



"""The build driver: a recipe in, an engine directory out, rebuilding only what changed.

Layout of the engine directory OUT (TensorRT-LLM conventions):

    OUT/config.json                     model HF config, mapping, per-rank mappings, recipe echo, thinking
                                        budgets, limits, tensor -> weight class map
    OUT/rank{N}/weights.safetensors     this rank's sharded / quantized weights
    OUT/rank{N}/quantization.json       per-tensor quantization errors (SQNR, max abs error)
    OUT/rank{N}/model.onnx              the rank's graph; initializers point into weights.safetensors
    OUT/rank{N}/ort_segment_*.onnx ...  ONNX Runtime backend: segments (+ plan) from the lowering
    OUT/rank{N}/rank{N}.engine          TensorRT backend: the serialized engine (`common/engine_file.py`)
    OUT/vision.safetensors, vision.onnx K3's vision tower + projector (bf16 tensors as stored) and its graph,
                                        one copy every rank loads (`graphs.vision_export`)
    OUT/vision.engine                   TensorRT backend, K3: the tower's engine, the one file every rank loads
                                        (`export/backends/tensorrt/vision.py`)
What a backend adds after a rank's graph (and after the vision graph) is its module in `export/backends/`.
    OUT/LICENSE                         the source checkpoint's license, copied
    OUT/tiktoken.model ...              the source checkpoint's tokenizer files (`TOKENIZER_FILES`), copied
    OUT/manifest.json                   written last: every file's size + sha256, versions, hashes, keys

The driver is this module; the stages every backend runs are `build.stages`, their records and scratch
folders `build.records`, the source `build.source`, the global artifacts, publishing and the manifest
`build.publish`.

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
    graph/rankN    convert identity (its key + the digest of the bytes it read) + attention + limits (but
                   checkpoints_per_slot: the runners' checkpoint pool; a graph's pools have symbolic sizes)
    lower/rankN    graph key                             (backend onnxruntime)
    engine/rankN   graph key + limits + target + workspace_reserve_gib   (backend tensorrt; checkpoints_per_slot
                   only on a CPU target, where the planner's pool sizes the engine records count the checkpoints)
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
exact rule is in `export/build/source_reads.py`. An unchanged rebuild reads no tensor data (validation still
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

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_export.common.atomic import atomic_write_bytes, canonical_json, sha256_file, sweep_temporaries
from moe_export.common.engine_config import CONFIG
from moe_export.common.errors import BuildError, InputError
from moe_export.common.manifest import MANIFEST, is_engine_dir
from moe_export.common.mapping import Mapping
from moe_export.common.mpi import world_comm
from moe_export.common.recipe import Recipe
from moe_export.export.build import source_reads
from moe_export.export.backends import Backend, backend_for
from moe_export.export.build.lock import OutputLock
from moe_export.export.build.progress import Progress
from moe_export.export.build.publish import build_globals, build_manifest, empty_build_folder, publish
from moe_export.export.build.records import StageRecords, stage_failed
from moe_export.export.build.source import (
    SYNTH_SEED,
    SYNTH_TEMP_RE,
    Source,
    identify_extras,
    source_location,
    vision_stamps,
)
from moe_export.export.build.stages import BuildContext, Stages, run_convert, run_graph, run_vision
from moe_export.export.build.stage_keys import (
    code_fingerprints,
    convert_identity,
    convert_key,
    global_keys,
    rank_keys,
    rank_stage_names,
    tower_key,
    vision_key,
)

__all__ = ["BuildError", "BuildResult", "Stages", "build", "describe"]


@dataclass
class BuildResult:
    """What one `build` call did."""

    out: Path
    ran: list[str] = field(default_factory=list)  # stages executed, e.g. "convert/rank0", "config"
    published: list[str] = field(default_factory=list)  # artifacts moved into OUT
    removed: list[str] = field(default_factory=list)  # stale artifacts removed from OUT
    manifest_written: bool = False
    reporter: bool = True  # False on MPI processes other than 0, which leave the reporting to process 0

    @property
    def up_to_date(self) -> bool:
        return not (self.ran or self.published or self.removed or self.manifest_written)


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


def _check_plan(recipe: Recipe) -> dict[int, int]:
    """The planner's checks (layout divides the model, weights fit) before any work; returns per-rank bytes."""
    from moe_export.export.plan.planner import make_plan

    plan = make_plan(recipe)
    if not plan.fits:
        raise InputError(f"recipe {recipe.name}: {plan.verdict()}")
    return {r.rank: r.weight_bytes["total"] for r in plan.per_rank}


def _check_output(out: Path) -> None:
    """Refuse an output path that is a file or a non-empty folder holding something else than a build."""
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (
            (out / ".state").is_dir() or (out / ".cache").is_dir() or is_engine_dir(out)):
        raise InputError(
            f"output {out}: directory is not empty and holds no moe-export build; choose an empty or new --out"
        )


def _prepare(ctx: BuildContext) -> None:
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
    kind, path, preset = source_location(ctx.recipe, out)
    if kind == "synthetic" and not path.is_dir():
        from moe_export.export.convert.synth import write_synthetic_checkpoint

        write_synthetic_checkpoint(preset, path, seed=SYNTH_SEED)


def _open_source(ctx: BuildContext) -> None:
    """Open and validate the source, identify it from config.json and the shard headers (no tensor data is
    read), and compute every convert key."""
    from moe_export.export.convert.checkpoint import INDEX_FILE, open_checkpoint

    kind, path, preset = source_location(ctx.recipe, ctx.out)
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


COMMON_RANK_RUNNERS = {"convert": run_convert, "graph": run_graph}


def _current_convert(ctx: BuildContext, n: int) -> dict | None:
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


def _rank_runner(backend: Backend, stage: str) -> Callable[..., tuple[list[str], Any, dict | None]]:
    """The function that runs `stage` of a rank: convert and graph are every backend's, the rest the backend's."""
    if stage in COMMON_RANK_RUNNERS:
        return COMMON_RANK_RUNNERS[stage]
    assert backend.rank_stage is not None and backend.rank_stage.name == stage, stage
    return backend.rank_stage.run


def _run_stage(ctx: BuildContext, stage: str, n: int, mapping: Mapping) -> dict:
    name = f"{stage}/rank{n}"
    try:
        outputs, result, source = _rank_runner(backend_for(ctx.recipe), stage)(ctx, n, mapping)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise stage_failed(f"{stage} of rank {n}", exc) from exc
    return ctx.state.record(name, ctx.keys[name], outputs, result, source)


def _build_ranks(ctx: BuildContext, ranks: list[int]) -> tuple[list[str], dict[str, str], dict[int, str]]:
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


def _run_tower(ctx: BuildContext, backend: Backend) -> list[str]:
    """The backend's stage after the vision graph (tensorrt: `vision_engine`), unless its record is current."""
    stage = backend.tower_stage
    if ctx.state.current(stage.name, ctx.keys[stage.name]):
        return []
    try:
        outputs, result, _ = stage.run(ctx)
    except (InputError, BuildError):
        raise
    except Exception as exc:
        raise stage_failed(stage.name.replace("_", " "), exc) from exc
    ctx.state.record(stage.name, ctx.keys[stage.name], outputs, result)
    return [stage.name]


def _stage_names(recipe: Recipe) -> list[str]:
    names = [f"{s}/rank{n}" for n in range(recipe.target.world_size) for s in rank_stage_names(recipe)]
    return names + ["config", "license", "tokenizer"]


def _finish(ctx: BuildContext, result: BuildResult) -> None:
    """Process 0, after every rank is built: config, LICENSE and tokenizer, publish, manifest last."""
    src = ctx.source
    identify_extras(src)
    identities = [convert_identity(ctx.keys[f"convert/rank{n}"], src.reads[n])
                  for n in range(ctx.recipe.target.world_size)]
    ctx.keys.update(global_keys(ctx.recipe, src.identity(), identities, src.license_sha256, src.tokenizer_files,
                                ctx.code))
    stamps = vision_stamps(ctx.reader)
    names = _stage_names(ctx.recipe)
    if stamps is not None:
        ctx.keys["vision"] = vision_key(ctx.recipe, src.identity(), stamps, ctx.code)
        names.append("vision")
    backend = backend_for(ctx.recipe)
    tower = stamps is not None and backend.tower_stage is not None
    if tower:
        ctx.keys[backend.tower_stage.name] = tower_key(ctx.recipe, backend.tower_stage.name, ctx.keys["vision"], ctx.code)
        names.append(backend.tower_stage.name)
    result.ran += build_globals(ctx) + run_vision(ctx) + (_run_tower(ctx, backend) if tower else [])
    records = {}
    for name in names:
        rec = ctx.state.current(name, ctx.keys[name])
        if rec is None:
            raise BuildError(f"stage {name} has no current record after the build (was .build/ modified meanwhile?)")
        records[name] = rec
    outputs = {rel: meta for rec in records.values() for rel, meta in rec["outputs"].items()}
    result.published, result.removed = publish(ctx, outputs)
    empty_build_folder(ctx.state.build)
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
    comm = comm or world_comm()
    stages = stages or Stages()
    out = Path(recipe.output if out is None else out).expanduser()
    expected = _check_plan(recipe)
    backend_for(recipe).check_available(recipe, stages)
    _check_output(out)
    prefix = f"[mpi {comm.rank}/{comm.size}] " if comm.size > 1 else ""
    ctx = BuildContext(recipe, out, stages, StageRecords(out), Progress(progress, prefix), expected)
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

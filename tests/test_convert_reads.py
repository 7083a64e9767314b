"""How much of the checkpoint a build reads: each rank reads its tensor-parallel slices (not whole tensors)
and its own experts, a fresh build reads each needed byte once (hashed as it is converted, no hashing pass),
an unchanged rebuild reads no weight data (only K3's A_log padding check), and a changed tensor is still
found (see export/build/source_reads.py for the rule)."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from moe_export.common.mapping import Mapping
from moe_export.export import build as build_mod
from moe_export.export.convert import checkpoint as ckpt_mod
from moe_export.export.build import source_reads
from moe_export.export.build import Stages
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.rank import convert_rank, rank_source_bytes
from test_build_driver import (
    FAKE_STAGES,
    fake_engine,
    fake_graph,
    fake_lower,
    settled,
    tiny_recipe,
)

REAL_CONVERT = Stages(export_rank_graph=fake_graph, backend_work={"lower": fake_lower, "engine": fake_engine})


class _CountedFile:
    """A file object that adds the bytes read through it to `counts[path]`."""

    def __init__(self, f, counts: dict[str, int], path: str) -> None:
        self._f, self._counts, self._path = f, counts, path

    def _add(self, data):
        n = len(data.encode() if isinstance(data, str) else data)
        self._counts[self._path] = self._counts.get(self._path, 0) + n
        return data

    def read(self, *args):
        return self._add(self._f.read(*args))

    def readline(self, *args):
        return self._add(self._f.readline(*args))

    def readinto(self, buf):
        n = self._f.readinto(buf)
        self._counts[self._path] = self._counts.get(self._path, 0) + (n or 0)
        return n

    def __iter__(self):
        return (self._add(line) for line in self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def file_reads(monkeypatch):
    """{path: bytes read through Python file objects} for files under the folders added to the returned
    dict's `roots` (tensor data is read through memory maps and counted by the reader instead)."""
    counts: dict[str, int] = {}
    roots: list[Path] = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if isinstance(file, int):
            return f
        path = Path(os.fsdecode(file)).resolve()
        return _CountedFile(f, counts, str(path)) if any(path.is_relative_to(r) for r in roots) else f

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    return counts, roots


@pytest.fixture
def readers(monkeypatch) -> list:
    """Every CheckpointReader constructed while the test runs."""
    made = []
    real_init = ckpt_mod.CheckpointReader.__init__

    def tracking_init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(ckpt_mod.CheckpointReader, "__init__", tracking_init)
    return made


def header_bytes(shard: Path) -> int:
    with shard.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def needed_bytes(source: Path, recipe) -> int:
    """Every rank's slices plus, for K3, the vision tower, which the build reads once for all ranks."""
    with open_checkpoint(source, validate=False) as reader:
        tower = sum(s.nbytes for s in reader.vision_specs())
        return tower + sum(rank_source_bytes(reader, reader.config, Mapping.from_recipe(recipe, n))
                           for n in range(recipe.target.world_size))


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_each_rank_reads_only_what_it_needs(synthetic_checkpoint, tmp_path, preset):
    recipe = tiny_recipe(f"synthetic:{preset}")  # tp=2, ep=2 on 4 ranks
    for rank in range(recipe.target.world_size):
        with open_checkpoint(synthetic_checkpoint(preset)) as reader:
            reader.bytes_read = 0  # validation's value checks read K3's A_log; count the conversion only
            mapping = Mapping.from_recipe(recipe, rank)
            convert_rank(reader, reader.config, recipe, mapping, tmp_path / f"rank{rank}.safetensors")
            ratio = reader.bytes_read / rank_source_bytes(reader, reader.config, mapping)
        assert ratio <= 1.0001, f"rank {rank} read {ratio:.3f}x the bytes it needs"


def test_fresh_build_reads_each_needed_byte_once(synthetic_checkpoint, tmp_path, readers, file_reads):
    """The real converter under the build driver: tensor data read <= 1.05x what the ranks need, and no
    shard is read through a file object beyond its header (no hashing pass)."""
    source = Path(synthetic_checkpoint("tiny-k3"))
    recipe = tiny_recipe(source)
    needed = needed_bytes(source, recipe)
    readers.clear()
    counts, roots = file_reads
    roots.append(source.resolve())
    build_mod.build(recipe, tmp_path / "engine", stages=REAL_CONVERT, progress=False)
    assert len(readers) == 1
    ratio = readers[0].bytes_read / needed
    print(f"fresh build: tensor bytes read / needed = {ratio:.4f}")
    assert ratio <= 1.05, f"a fresh build read {ratio:.3f}x the tensor bytes its ranks need"
    shards = sorted(source.glob("model-*.safetensors"))
    assert {p: counts.get(str(p.resolve()), 0) for p in shards} == {p: header_bytes(p) for p in shards}


def test_changed_tensor_reruns_the_ranks_that_read_it(synthetic_checkpoint, tmp_path):
    """One byte of the embedding's first row changed (same size, same header): the ranks holding that vocab
    slice (tp position 0: ranks 0 and 2) convert again and their weights change; ranks 1 and 3 do not."""
    src = tmp_path / "src"
    shutil.copytree(synthetic_checkpoint("tiny-k3"), src)
    settled(src)
    recipe = tiny_recipe(src)
    out = tmp_path / "engine"
    build_mod.build(recipe, out, stages=REAL_CONVERT, progress=False)
    weights = {n: (out / f"rank{n}" / "weights.safetensors").read_bytes() for n in range(4)}
    with open_checkpoint(src, validate=False) as reader:
        embed = reader.stored(reader.expected_specs()[0].name)
    assert embed.name.endswith("embed_tokens.weight")
    with open(src / embed.file, "r+b") as f:
        f.seek(embed.start)
        byte = f.read(1)[0]
        f.seek(embed.start)
        f.write(bytes([byte ^ 0x40]))
    res = build_mod.build(recipe, out, stages=REAL_CONVERT, progress=False)
    assert [n for n in res.ran if n.startswith("convert/")] == ["convert/rank0", "convert/rank2"]
    after = {n: (out / f"rank{n}" / "weights.safetensors").read_bytes() for n in range(4)}
    assert [n for n in range(4) if after[n] != weights[n]] == [0, 2]
    assert build_mod.build(recipe, out, stages=REAL_CONVERT, progress=False).up_to_date


def test_unchanged_rebuild_reads_no_weight_data(synthetic_checkpoint, tmp_path, monkeypatch, readers, file_reads):
    source = settled(Path(synthetic_checkpoint("tiny-k3")))
    recipe = tiny_recipe(source)
    out = tmp_path / "engine"
    build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False)
    readers.clear()
    counts, roots = file_reads
    roots.append(source.resolve())
    assert build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date
    a_log = sum(r.nbytes(n) for r in readers for n in r.tensor_names() if n.endswith("A_log"))
    assert readers and sum(r.bytes_read for r in readers) == a_log  # only the A_log padding check
    assert a_log < 0.001 * sum(p.stat().st_size for p in source.glob("*.safetensors"))
    shards = sorted(source.glob("model-*.safetensors"))
    assert {p: counts.get(str(p.resolve()), 0) for p in shards} == {p: header_bytes(p) for p in shards}


def test_source_written_just_before_the_build_is_verified_by_content(synthetic_checkpoint, tmp_path, readers,
                                                                     monkeypatch):
    """A shard changed less than RACY_NS before it was read gets no stamp (it could change again within the
    same timestamp tick): the next build re-reads and compares the rank's slices of it, without rerunning
    anything, and trusts it once it is older."""
    src = tmp_path / "src"
    shutil.copytree(synthetic_checkpoint("tiny-k3"), src)  # fresh files
    recipe = tiny_recipe(src)
    out = tmp_path / "engine"
    racy_ns = source_reads.RACY_NS
    monkeypatch.setattr(source_reads, "RACY_NS", 3600 * 10**9)  # "fresh" however slowly this build starts
    build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False)
    monkeypatch.setattr(source_reads, "RACY_NS", racy_ns)
    records = {n: json.loads((out / ".state" / f"convert-rank{n}.json").read_text())["source"] for n in range(4)}
    assert all(e["stamp"] is None for rec in records.values() for e in rec["files"].values())
    needed = sum(r.nbytes(name) for r in readers[:1] for rec in records.values()
                 for e in rec["files"].values() for name, _, _ in e["reads"])  # fake_convert reads whole tensors
    settled(src)
    readers.clear()
    assert build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date
    a_log = sum(readers[0].nbytes(n) for n in readers[0].tensor_names() if n.endswith("A_log"))
    assert readers[0].bytes_read == needed + a_log
    readers.clear()
    assert build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date
    assert readers[0].bytes_read == a_log

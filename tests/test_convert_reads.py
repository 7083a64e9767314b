"""How much of the checkpoint a build reads: each rank reads its tensor-parallel slices (not whole tensors)
and its own experts, and an unchanged rebuild reads no weight data (only K3's A_log padding check)."""

from __future__ import annotations

import pytest

from moe_export.export import build as build_mod
from moe_export.export import checkpoint as ckpt_mod
from moe_export.export.checkpoint import open_checkpoint
from moe_export.export.convert import convert_rank, rank_source_bytes
from moe_export.export.stage_keys import rank_mapping


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_each_rank_reads_only_what_it_needs(synthetic_checkpoint, tmp_path, preset):
    from test_build_driver import tiny_recipe

    recipe = tiny_recipe(f"synthetic:{preset}")  # tp=2, ep=2 on 4 ranks
    for rank in range(recipe.target.world_size):
        with open_checkpoint(synthetic_checkpoint(preset)) as reader:
            reader.bytes_read = 0  # validation's value checks read K3's A_log; count the conversion only
            mapping = rank_mapping(recipe, rank)
            convert_rank(reader, reader.config, recipe, mapping, tmp_path / f"rank{rank}.safetensors")
            ratio = reader.bytes_read / rank_source_bytes(reader, reader.config, mapping)
        assert ratio <= 1.0001, f"rank {rank} read {ratio:.3f}x the bytes it needs"


def test_unchanged_rebuild_reads_no_weight_data(tmp_path, monkeypatch):
    from test_build_driver import FAKE_STAGES, tiny_recipe

    recipe = tiny_recipe("synthetic:tiny-k3")
    out = tmp_path / "engine"
    build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False)
    readers = []
    real_init = ckpt_mod.CheckpointReader.__init__

    def tracking_init(self, *a, **kw):
        real_init(self, *a, **kw)
        readers.append(self)

    hashed = []
    real_sha = build_mod.sha256_file
    monkeypatch.setattr(ckpt_mod.CheckpointReader, "__init__", tracking_init)
    monkeypatch.setattr(build_mod, "sha256_file", lambda p: hashed.append(str(p)) or real_sha(p))
    assert build_mod.build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date
    source = next((out / ".cache").glob("source-*"))
    assert not [p for p in hashed if p.endswith(".safetensors")], hashed  # source hashes come from the cache
    a_log = sum(r.nbytes(n) for r in readers for n in r.tensor_names() if n.endswith("A_log"))
    assert readers and sum(r.bytes_read for r in readers) == a_log  # only the A_log padding check
    assert a_log < 0.001 * sum(p.stat().st_size for p in source.glob("*.safetensors"))

"""The build driver (keys, partial rebuilds, atomicity, resume after SIGKILL, MPI, bad input), run with
small deterministic stand-in stages so the driver logic is tested on its own. `test_build_e2e.py`
runs the real stages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import torch
import yaml
from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.common.manifest import artifact_files, verify_engine_dir
from moe_export.common.recipe import Recipe
from moe_export.export.build import source_reads
from moe_export.export.build import BuildError, Stages, build, describe
from moe_export.export.convert.checkpoint import read_safetensors_header
from moe_export.export.build.stage_keys import (
    STAGE_FIELDS,
    code_fingerprints,
    convert_identity,
    convert_key,
    global_keys,
    rank_keys,
)
from moe_export.graphs.sharding import shard_tensor
from moe_export.graphs.weights import global_tensor_specs, layer_tensor_specs
from moe_export.plugins import DOMAIN
from moe_export.recipes import recipes_dir
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TOKENIZER = ["tiktoken.model", "tokenizer_config.json", "preprocessor_config.json"]  # what synth writes (K3)


# ---- stand-in stages: small, deterministic, and shaped like the real ones ----
def fake_convert(reader, cfg, recipe, mapping, out_path):
    """Embedding and a dense FFN weight sliced for the rank, the final norm, this rank's experts of the
    first MoE layer; dense stored as fp8 when the recipe asks for it."""
    from safetensors.torch import save_file

    globals_ = {s.weight_class: s for s in global_tensor_specs(cfg)}
    dense = next(s for s in layer_tensor_specs(cfg, 0) if s.weight_class == "dense")
    moe_layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    tensors = {
        globals_["embeddings"].name: shard_tensor(globals_["embeddings"], reader.get(globals_["embeddings"].name), mapping),
        globals_["norms"].name: reader.get(globals_["norms"].name),
        dense.name: shard_tensor(dense, reader.get(dense.name), mapping),
    }
    if recipe.quantization.dense == "fp8":
        tensors[dense.name] = tensors[dense.name].to(torch.float8_e4m3fn)
    for spec in layer_tensor_specs(cfg, moe_layer):
        if spec.expert in mapping.local_experts(cfg.num_experts):
            tensors[spec.name] = reader.get(spec.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_path), metadata={"rank": str(mapping.rank)})
    time.sleep(float(os.environ.get("FAKE_STAGE_SLEEP", "0")))
    entries = [{"name": k, "sqnr_db": 40.0 - i, "max_abs_err": 0.001 * i} for i, k in enumerate(sorted(tensors))]
    return {"tensors": entries, "summary": {"quantized_tensors": len(entries)}}


def fake_graph(cfg, recipe, mapping, weights_path, out_path):
    """Gather from the embedding (external data in the weights file) -> plugin attention -> AllReduce."""
    stored = {t.name: t for t in read_safetensors_header(Path(weights_path))[0]}
    embed = stored[global_tensor_specs(cfg)[0].name]
    init = TensorProto(name="embed", data_type=TensorProto.BFLOAT16, dims=list(embed.shape))
    init.data_location = TensorProto.EXTERNAL
    for k, v in (("location", Path(weights_path).name), ("offset", str(embed.start)), ("length", str(embed.nbytes))):
        entry = init.external_data.add()
        entry.key, entry.value = k, v
    topk = recipe.attention.sparse_topk or 0
    nodes = [
        helper.make_node("Cast", ["embed"], ["embed_f32"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["embed_f32", "ids"], ["h"]),
        helper.make_node("SparseMLAAttention", ["h"], ["a"], domain=DOMAIN, topk=topk,
                         max_seq_len=recipe.limits.max_seq_len),
        helper.make_node("AllReduce", ["a"], ["y"], domain=DOMAIN, group="tp"),
    ]
    graph = helper.make_graph(
        nodes, f"rank{mapping.rank}", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", cfg.hidden_size])], [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    Path(out_path).write_bytes(model.SerializeToString(deterministic=True))
    return {"nodes": len(nodes)}


def fake_lower(graph_path, out_dir):
    """One segment per plugin node plus one when a sparse top-k is set, and a plan file; needs the weights
    next to the segments."""
    out_dir = Path(out_dir)
    assert (out_dir / "weights.safetensors").is_file(), "segments must sit next to the weights"
    model = onnx.load(str(graph_path), load_external_data=False)
    topk = next(helper.get_attribute_value(a) for n in model.graph.node for a in n.attribute if a.name == "topk")
    names = []
    for i in range(1 + (topk > 0)):
        names.append(f"ort_segment_{i:03d}.onnx")
        (out_dir / names[-1]).write_bytes(model.SerializeToString(deterministic=True) + bytes([i]))
    (out_dir / "ort_plan.json").write_text(json.dumps({"steps": names}, sort_keys=True))
    return names + ["ort_plan.json"]


def fake_engine(graph_path, recipe, mapping, out_path):
    Path(out_path).write_bytes(Path(graph_path).read_bytes() + f"engine {mapping.rank}".encode())


def fake_vision_engine(graph_path, recipe, cfg, out_path):
    assert (Path(graph_path).parent / "vision.safetensors").is_file(), "the tower graph must sit next to its weights"
    Path(out_path).write_bytes(Path(graph_path).read_bytes() + f"vision engine tp{recipe.parallel.tp}".encode())


FAKE_STAGES = Stages(fake_convert, fake_graph,
                     {"lower": fake_lower, "engine": fake_engine, "vision_engine": fake_vision_engine})


# ---- helpers ----
def recipe_dict(source: str | Path, **changes) -> dict:
    """tiny-cpu.yaml with `model.source` replaced and dotted-path `changes` applied."""
    data = yaml.safe_load((recipes_dir() / "tiny-cpu.yaml").read_text())
    data["model"]["source"] = str(source)
    for dotted, value in changes.items():
        cur = data
        *parents, last = dotted.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return data


def tiny_recipe(source: str | Path, **changes) -> Recipe:
    return Recipe.model_validate(recipe_dict(source, **changes))


def snapshot(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in artifact_files(root)}


def inodes(root: Path) -> dict[str, tuple[int, int]]:
    return {rel: ((root / rel).stat().st_ino, (root / rel).stat().st_mtime_ns) for rel in artifact_files(root)}


def assert_published_alone(out: Path) -> None:
    """Every artifact has exactly one hard link (onnx.checker refuses external data with more) and
    nothing is left staged in .build."""
    links = {rel: (out / rel).stat().st_nlink for rel in [*artifact_files(out), "manifest.json"]}
    assert set(links.values()) == {1}, links
    assert list((out / ".build").iterdir()) == []


def settled(root: Path) -> Path:
    """Wait until every file under `root` last changed more than `source_reads.RACY_NS` ago, so a build
    trusts the stamps it records for them (a fresher file is verified by content at the next build)."""
    newest = max(p.stat().st_ctime_ns for p in Path(root).rglob("*") if p.is_file())
    time.sleep(max(0, newest + source_reads.RACY_NS - time.time_ns()) / 1e9 + 0.01)
    return Path(root)


@pytest.fixture(scope="module")
def ckpt(synthetic_checkpoint) -> Path:
    return settled(Path(synthetic_checkpoint("tiny-k3")))


HELPER = """
import functools, sys
sys.path.insert(0, {tests!r})
import test_build_driver as t
import moe_export.export.build as b
b.build = functools.partial(b.build, stages=t.FAKE_STAGES)
from moe_export.runtime.entrypoints.cli import main
sys.argv = ["moe-export", *sys.argv[1:]]
main()
"""


def cli_with_fakes(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """`moe-export ARGS` in a subprocess whose build uses FAKE_STAGES."""
    code = HELPER.format(tests=str(Path(__file__).parent))
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ---- keys ----
def stage_keys(recipe: Recipe, source_id: str, license_sha256: str | None, tokenizer_files: dict[str, str],
               reads: dict[int, str] | None = None) -> dict[str, str]:
    """Every stage's key at once, given each rank's reads digest (default ""), composed as the build does."""
    code = code_fingerprints()
    keys: dict[str, str] = {}
    identities = []
    for n in range(recipe.target.world_size):
        keys[f"convert/rank{n}"] = convert_key(recipe, source_id, n, code)
        identities.append(convert_identity(keys[f"convert/rank{n}"], (reads or {}).get(n, "")))
        keys.update(rank_keys(recipe, n, identities[-1], code))
    keys.update(global_keys(recipe, source_id, identities, license_sha256, tokenizer_files, code))
    return keys


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"thinking.high": 300}, {"config"}),
        ({"quantization.dense": "fp8"}, {"convert", "graph", "lower", "config"}),
        ({"attention.sparse_topk": 2}, {"graph", "lower", "config"}),
        ({"limits.max_seq_len": 256}, {"graph", "lower", "config"}),
        ({"name": "other"}, {"config"}),
        ({"workspace_reserve_gib": 0.5}, {"config"}),
        ({"limits.checkpoints_per_slot": 4}, {"config"}),  # the runners' checkpoint pool: no graph holds it
    ],
)
def test_stage_keys_change_only_where_the_recipe_field_matters(change, expected):
    base = stage_keys(tiny_recipe("synthetic:tiny-k3"), "src", None, {})
    new = stage_keys(tiny_recipe("synthetic:tiny-k3", **change), "src", None, {})
    changed = {name.split("/")[0] for name in base if base[name] != new[name]}
    assert changed == expected
    assert len(base) == 4 * 3 + 3


def test_stage_keys_engine_and_source():
    trt = tiny_recipe("synthetic:tiny-k3", backend="tensorrt")
    base = stage_keys(trt, "src", None, {})
    assert {k.split("/")[0] for k in base} == {"convert", "graph", "engine", "config", "license", "tokenizer"}
    more = stage_keys(tiny_recipe("synthetic:tiny-k3", backend="tensorrt", workspace_reserve_gib=0.5), "src", None, {})
    assert {k.split("/")[0] for k in base if base[k] != more[k]} == {"engine", "config"}
    other_src = stage_keys(trt, "other", None, {})
    assert all(base[k] != other_src[k] for k in base if k not in ("license", "tokenizer"))
    licensed = stage_keys(trt, "src", "abc", {})
    assert {k for k in base if base[k] != licensed[k]} == {"license"}
    tokenized = stage_keys(trt, "src", None, {"tokenizer.json": "abc"})
    assert {k for k in base if base[k] != tokenized[k]} == {"tokenizer"}
    read_other = stage_keys(trt, "src", None, {}, reads={1: "other bytes"})  # rank 1 read other tensor bytes
    assert {k for k in base if base[k] != read_other[k]} == {"graph/rank1", "engine/rank1", "config"}
    assert set(STAGE_FIELDS) == {"convert", "graph", "lower", "engine", "vision", "vision_engine"}
    # the checkpoint budget reaches a TensorRT engine through the planner's pool sizes (its `pool_limits`), which
    # count the checkpoints only on a CPU target (`bytes_per_checkpoint`: pinned host memory beside a GPU)
    for gpu, changed in (("cpu", {"engine", "config"}), ("h100", {"config"})):
        target = {"target.gpu": gpu, "target.memory_gib": 80}
        base = stage_keys(tiny_recipe("synthetic:tiny-k3", backend="tensorrt", **target), "src", None, {})
        fewer = stage_keys(tiny_recipe("synthetic:tiny-k3", backend="tensorrt", **target,
                                       **{"limits.checkpoints_per_slot": 4}), "src", None, {})
        assert {k.split("/")[0] for k in base if base[k] != fewer[k]} == changed, gpu


# ---- builds ----
def test_synthetic_build_layout_manifest_and_noop_rerun(tmp_path, capsys):
    out = tmp_path / "engine"
    recipe = tiny_recipe("synthetic:tiny-k3")
    res = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert res.ran == [f"{s}/rank{n}" for n in range(4) for s in ("convert", "graph", "lower")] + [
        "config", "license", "tokenizer", "vision"]
    files = artifact_files(out)
    for n in range(4):
        for name in ("weights.safetensors", "quantization.json", "model.onnx", "ort_segment_000.onnx", "ort_plan.json"):
            assert f"rank{n}/{name}" in files
    assert {"config.json", "LICENSE", *TOKENIZER, "vision.onnx", "vision.safetensors"} <= set(files)
    assert_published_alone(out)
    assert (out / ".cache" / "source-tiny-k3-seed0" / "config.json").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["files"]) == files
    assert manifest["source"]["kind"] == "synthetic" and manifest["source"]["preset"] == "tiny-k3"
    assert manifest["source"]["seed"] == 0
    assert {"config.json", "model.safetensors.index.json"} <= set(manifest["source"]["files"])
    assert all(f["size"] > 0 for f in manifest["source"]["files"].values())
    assert len(manifest["source"]["config_sha256"]) == len(manifest["source"]["layout_sha256"]) == 64
    assert sorted(manifest["source"]["reads_sha256"]) == [f"rank{n}" for n in range(4)]
    assert set(manifest["versions"]) == {"moe_export", "torch", "onnx", "onnxruntime", "numpy", "safetensors", "python"}
    assert manifest["recipe"]["sha256"] == recipe.fingerprint()
    assert manifest["license"]["file"] == "LICENSE"
    assert manifest["quantization"]["min_sqnr_db"] is not None
    assert set(manifest["stages"]) == set(stage_keys(recipe, "x", None, {})) | {"vision"}
    assert str(tmp_path) not in (out / "manifest.json").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 2, "ep_size": 2, "attention": "tp"}
    assert [r["rank"] for r in cfg["ranks"]] == [0, 1, 2, 3]
    assert cfg["thinking"] == {"low": 64, "high": 256, "max": 512}
    assert cfg["pretrained_config"]["model_type"] == "kimi_k3"
    assert cfg["weight_classes"]["language_model.model.embed_tokens.weight"] == "embeddings"
    assert verify_engine_dir(out)["ok"]
    # same inputs: nothing runs, nothing is rewritten
    before = inodes(out)
    again = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert again.up_to_date and describe(again).startswith("up to date: nothing to do")
    assert inodes(out) == before


def test_thinking_change_rewrites_only_config_and_manifest(ckpt, tmp_path):
    out = tmp_path / "e"
    build(tiny_recipe(ckpt), out, stages=FAKE_STAGES, progress=False)
    before, state_before = inodes(out), inodes(out / ".state")
    manifest_before = (out / "manifest.json").read_bytes()
    res = build(tiny_recipe(ckpt, **{"thinking.high": 300}), out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["config"]
    after = inodes(out)
    assert {k for k in before if before[k] != after[k]} == {"config.json"}
    assert (out / "manifest.json").read_bytes() != manifest_before
    assert json.loads((out / "config.json").read_text())["thinking"]["high"] == 300
    state_after = inodes(out / ".state")
    assert {k for k in state_before if state_before[k] != state_after.get(k)} == {"config.json", "publish.json"}
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


def test_checkpoint_budget_change_rewrites_only_config(ckpt, tmp_path):
    """`limits.checkpoints_per_slot` is read by the runners from config.json (the checkpoint pool they allocate);
    the graphs take their pools with symbolic sizes: a rebuild with another value reuses every other stage."""
    out = tmp_path / "e"
    build(tiny_recipe(ckpt), out, stages=FAKE_STAGES, progress=False)
    before = inodes(out)
    res = build(tiny_recipe(ckpt, **{"limits.checkpoints_per_slot": 4}), out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["config"]
    after = inodes(out)
    assert {k for k in before if before[k] != after[k]} == {"config.json"}
    assert EngineConfig.read(out).limits.checkpoints_per_slot == 4
    assert verify_engine_dir(out)["ok"]


def test_quantization_change_rebuilds_convert_graph_lowering(ckpt, tmp_path):
    out = tmp_path / "e"
    build(tiny_recipe(ckpt), out, stages=FAKE_STAGES, progress=False)
    before = inodes(out)
    res = build(tiny_recipe(ckpt, **{"quantization.dense": "fp8"}), out, stages=FAKE_STAGES, progress=False)
    assert res.ran == [f"{s}/rank{n}" for n in range(4) for s in ("convert", "graph", "lower")] + ["config"]
    after = inodes(out)
    assert {k for k in before if before[k] != after[k]} == set(before) - {"LICENSE", *TOKENIZER, "vision.onnx", "vision.safetensors"}
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


def test_fewer_segments_and_backend_switch_remove_stale_artifacts(ckpt, tmp_path):
    out = tmp_path / "e"
    build(tiny_recipe(ckpt, **{"attention.sparse_topk": 2}), out, stages=FAKE_STAGES, progress=False)
    assert (out / "rank0" / "ort_segment_001.onnx").is_file()
    weights = inodes(out)["rank0/weights.safetensors"]
    # the graph and lowering run again against the weights already published in OUT
    res = build(tiny_recipe(ckpt), out, stages=FAKE_STAGES, progress=False)
    assert res.ran == [f"{s}/rank{n}" for n in range(4) for s in ("graph", "lower")] + ["config"]
    assert inodes(out)["rank0/weights.safetensors"] == weights
    assert "rank0/ort_segment_001.onnx" in res.removed
    assert not (out / "rank0" / "ort_segment_001.onnx").exists()
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)
    res = build(tiny_recipe(ckpt, backend="tensorrt"), out, stages=FAKE_STAGES, progress=False)
    # TensorRT engines hold the experts in the Triton kernel's layout (export/convert/rank.py): converted again
    assert res.ran == [f"{s}/rank{n}" for n in range(4) for s in ("convert", "graph", "engine")] + ["config",
                                                                                                   "vision_engine"]
    weights = inodes(out)["rank0/weights.safetensors"]
    files = artifact_files(out)
    assert "rank2/rank2.engine" in files and "vision.engine" in files and not any("ort_" in f for f in files)
    assert (out / "vision.engine").read_bytes() == (out / "vision.onnx").read_bytes() + b"vision engine tp2"
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)
    # the graph staged in .build, the weights published: the engine builder sees them side by side
    res = build(tiny_recipe(ckpt, backend="tensorrt", **{"limits.max_seq_len": 256}), out, stages=FAKE_STAGES,
                progress=False)  # the tower engine does not depend on the text limits: kept
    assert res.ran == [f"{s}/rank{n}" for n in range(4) for s in ("graph", "engine")] + ["config"]
    assert inodes(out)["rank0/weights.safetensors"] == weights
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


def test_deleted_or_touched_outputs_are_repaired(ckpt, tmp_path):
    out = tmp_path / "e"
    recipe = tiny_recipe(ckpt)
    build(recipe, out, stages=FAKE_STAGES, progress=False)
    (out / "rank1" / "model.onnx").unlink()  # the only copy: the graph stage runs again
    res = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["graph/rank1"] and res.published == ["rank1/model.onnx"] and res.manifest_written
    os.utime(out / "rank3" / "weights.safetensors", ns=(1, 1))  # looks modified: convert reruns
    res = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["convert/rank3"]
    # replaced by a copy with the same size and mtime (cp -p): a different inode, so it reruns too
    plan = out / "rank2" / "ort_plan.json"
    shutil.copy2(plan, tmp_path / "plan")
    os.replace(tmp_path / "plan", plan)
    res = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["lower/rank2"]
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


def test_source_changes_rerun_only_the_ranks_that_read_them(tmp_path, ckpt):
    """Touched shards are re-read and compared, not reconverted; a changed byte (same size, same header)
    reruns the ranks that read it and what depends on them, even with the file's mtime restored."""
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    settled(src)
    out = tmp_path / "e"
    recipe = tiny_recipe(src)
    build(recipe, out, stages=FAKE_STAGES, progress=False)
    stamps = {n: json.loads((out / ".state" / f"convert-rank{n}.json").read_text())["source"]["files"] for n in range(4)}
    assert all(e["stamp"] is not None for files in stamps.values() for e in files.values())
    expert = next(name for files in stamps.values() for f in files.values() for name, _, _ in f["reads"]
                  if ".experts.0." in name)  # fake_convert reads the experts of the first MoE layer
    stored = {t.name: t for shard in src.glob("model-*.safetensors") for t in read_safetensors_header(shard)[0]}[expert]
    shard = src / stored.file
    os.utime(shard, ns=(5, 5))
    before = inodes(out)
    assert build(recipe, out, stages=FAKE_STAGES, progress=False).up_to_date
    assert inodes(out) == before
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[stored.start] ^= 0x01  # same size, same header, one byte of expert 0: held by ranks 0 and 2
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime restored: the ctime still moved
    res = build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert res.ran == [f"{s}/rank{n}" for n in (0, 2) for s in ("convert", "graph", "lower")] + ["config"]
    after = inodes(out)
    assert {k for k in before if before[k] != after[k]} == {
        f"rank{n}/{f}" for n in (0, 2) for f in ("weights.safetensors", "quantization.json", "model.onnx",
                                                 "ort_segment_000.onnx", "ort_plan.json")} | {"config.json"}
    assert verify_engine_dir(out)["ok"]


def test_source_without_license_is_noted(tmp_path, ckpt):
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    (src / "LICENSE").unlink()
    out = tmp_path / "e"
    build(tiny_recipe(src), out, stages=FAKE_STAGES, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["license"]["file"] is None and "no LICENSE" in manifest["license"]["note"]
    assert not (out / "LICENSE").exists()
    assert manifest["source"]["kind"] == "checkpoint" and manifest["source"]["path"] == str(src)


def test_tokenizer_files_are_copied_and_follow_the_source(tmp_path, ckpt):
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    out = tmp_path / "e"
    build(tiny_recipe(src), out, stages=FAKE_STAGES, progress=False)
    for name in TOKENIZER:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert set(TOKENIZER) <= set(json.loads((out / "manifest.json").read_text())["files"])
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "tiktoken.model").unlink()
    res = build(tiny_recipe(src), out, stages=FAKE_STAGES, progress=False)
    assert res.ran == ["tokenizer"] and res.removed == ["tiktoken.model"]
    assert res.published == ["chat_template.jinja", "preprocessor_config.json", "tokenizer_config.json"]
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


# ---- bad input ----
def test_corrupt_shard_is_refused_and_previous_output_untouched(tmp_path, ckpt):
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    out = tmp_path / "e"
    build(tiny_recipe(src), out, stages=FAKE_STAGES, progress=False)
    before = snapshot(out)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(InputError, match="truncated"):
        build(tiny_recipe(src), out, stages=FAKE_STAGES, progress=False)
    assert snapshot(out) == before
    assert verify_engine_dir(out)["ok"]


def test_output_path_problems(tmp_path, ckpt):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        build(tiny_recipe(ckpt), afile, stages=FAKE_STAGES, progress=False)
    with pytest.raises(InputError, match="cannot write"):
        build(tiny_recipe(ckpt), afile / "sub", stages=FAKE_STAGES, progress=False)
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="holds no moe-export build"):
        build(tiny_recipe(ckpt), foreign, stages=FAKE_STAGES, progress=False)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_layout_that_does_not_divide_the_experts_is_refused_before_any_work(tmp_path, ckpt):
    out = tmp_path / "e"
    recipe = tiny_recipe(ckpt, **{"target.gpus_per_node": 6, "parallel.ep": 3})
    with pytest.raises(InputError, match="num_experts=8 is not divisible by ep=3"):
        build(recipe, out, stages=FAKE_STAGES, progress=False)
    assert not out.exists()


def test_tensorrt_backend_without_tensorrt_is_refused_before_any_work(tmp_path, ckpt):
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    out = tmp_path / "e"
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        build(tiny_recipe(ckpt, backend="tensorrt"), out, progress=False)
    assert not out.exists()


def test_failing_stage_leaves_previous_output_and_raises_build_error(tmp_path, ckpt):
    out = tmp_path / "e"
    build(tiny_recipe(ckpt), out, stages=FAKE_STAGES, progress=False)
    before = snapshot(out)

    def broken_graph(*args):
        raise RuntimeError("exporter bug")

    stages = Stages(fake_convert, broken_graph, {"lower": fake_lower, "engine": fake_engine})
    with pytest.raises(BuildError, match="graph of rank 0 failed: RuntimeError: exporter bug"):
        build(tiny_recipe(ckpt, **{"quantization.dense": "fp8"}), out, stages=stages, progress=False)
    assert snapshot(out) == before
    assert (out / "manifest.json").is_file()
    assert (out / ".build" / "rank0" / "weights.safetensors").is_file()  # staged, not published
    # the convert stage of rank 0 finished and is kept: the next run resumes after it
    res = build(tiny_recipe(ckpt, **{"quantization.dense": "fp8"}), out, stages=FAKE_STAGES, progress=False)
    assert "convert/rank0" not in res.ran and "graph/rank0" in res.ran
    assert verify_engine_dir(out)["ok"]
    assert_published_alone(out)


def test_disk_full_is_a_clear_error_and_previous_output_untouched(tmp_path, ckpt):
    import resource

    out = tmp_path / "e"
    good = write_recipe(tmp_path / "good.yaml", recipe_dict(ckpt))
    proc = cli_with_fakes("build", "--recipe", str(good), "--out", str(out))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    before = snapshot(out)
    changed = write_recipe(tmp_path / "fp8.yaml", recipe_dict(ckpt, **{"quantization.dense": "fp8"}))

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    proc = cli_with_fakes("build", "--recipe", str(changed), "--out", str(out), preexec_fn=limit_file_size)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "file size limit" in err and "convert of rank 0 failed" in err
    assert snapshot(out) == before
    assert verify_engine_dir(out)["ok"]


# ---- resume and MPI (subprocesses) ----
def test_killed_build_resumes_to_identical_bytes(tmp_path):
    recipe_path = write_recipe(tmp_path / "r.yaml", recipe_dict("synthetic:tiny-k3"))
    killed = tmp_path / "killed"
    proc = cli_with_fakes("build", "--recipe", str(recipe_path), "--out", str(killed), env={"FAKE_STAGE_SLEEP": "1.5"})
    first = killed / ".state" / "convert-rank0.json"
    deadline = time.monotonic() + 240
    while not first.is_file():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the first stage never finished"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (killed / "manifest.json").exists()
    assert not (killed / ".state" / "convert-rank3.json").exists()

    proc = cli_with_fakes("build", "--recipe", str(recipe_path), "--out", str(killed))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "convert x3" in out  # rank 0's convert was kept

    clean = tmp_path / "clean"
    build(Recipe.model_validate(recipe_dict("synthetic:tiny-k3")), clean, stages=FAKE_STAGES, progress=False)
    assert snapshot(killed) == snapshot(clean)
    assert verify_engine_dir(killed)["ok"]
    assert_published_alone(killed)


@pytest.mark.slow  # 20-42 s on 2 cores: the default run stays under 20 minutes
def test_second_build_into_a_locked_output_exits_2_naming_the_holder(tmp_path):
    """While one build runs, a second into the same OUT exits 2 naming the first's pid (without sweeping the
    first's temporary files); the first finishes with a verified output."""
    recipe_path = write_recipe(tmp_path / "r.yaml", recipe_dict("synthetic:tiny-k3"))
    out = tmp_path / "engine"
    first = cli_with_fakes("build", "--recipe", str(recipe_path), "--out", str(out), env={"FAKE_STAGE_SLEEP": "6"})
    deadline = time.monotonic() + 240
    while not (out / ".state" / "convert-rank0.json").is_file():
        assert first.poll() is None, first.communicate()[1]
        assert time.monotonic() < deadline, "the first stage never finished"
        time.sleep(0.05)
    second = cli_with_fakes("build", "--recipe", str(recipe_path), "--out", str(out))
    _, err = second.communicate(timeout=120)
    assert first.poll() is None, "the first build ended before the second one started"
    assert second.returncode == 2, err
    assert f"pid {first.pid}" in err and "another build" in err and "Traceback" not in err
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert verify_engine_dir(out)["ok"]
    third = cli_with_fakes("build", "--recipe", str(recipe_path), "--out", str(out))  # the lock was released
    assert third.communicate(timeout=120)[0].startswith("up to date") and third.returncode == 0


def test_mpi_processes_split_the_ranks(tmp_path, ckpt):
    mpiexec = VENV_BIN / "mpiexec"
    assert mpiexec.is_file(), "mpiexec (mpich, in the test extra) is not installed in the environment"
    recipe_path = write_recipe(tmp_path / "r.yaml", recipe_dict(ckpt))
    out = tmp_path / "mpi"
    code = HELPER.format(tests=str(Path(__file__).parent))
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, "-c", code, "build", "--recipe", str(recipe_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ran convert x4") == 1  # process 0 reports for both
    for line in ("[mpi 0/2] convert rank 0", "[mpi 1/2] convert rank 1", "[mpi 0/2] convert rank 2",
                 "[mpi 1/2] convert rank 3"):
        assert line in proc.stderr
    serial = tmp_path / "serial"
    build(tiny_recipe(ckpt), serial, stages=FAKE_STAGES, progress=False)
    assert snapshot(out) == snapshot(serial)

"""CheckpointReader / open_checkpoint on good and broken checkpoints; every broken one fails through the
CLI with exit 2, one clear paragraph naming the file or tensor, and no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from moe_export.common.errors import InputError
from moe_export.export.convert.checkpoint import (
    INDEX_FILE,
    CheckpointReader,
    checkpoint_fingerprint,
    open_checkpoint,
    read_safetensors_header,
)
from moe_export.export.convert.synth import synthetic_specs, write_synthetic_checkpoint
from safetensors.torch import load_file, save_file

LAYER1 = "model.layers.1."


@pytest.fixture(scope="module")
def clean_kl(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint("tiny-kimi-linear", tmp_path_factory.mktemp("ckpt") / "kl", seed=3)


@pytest.fixture
def ckpt(clean_kl, tmp_path) -> Path:
    """A private copy of the clean tiny-kimi-linear checkpoint, free to break."""
    return Path(shutil.copytree(clean_kl, tmp_path / "kl"))




def index_of(root: Path) -> dict:
    return json.loads((root / INDEX_FILE).read_text())


def shard_of(root: Path, name: str) -> Path:
    return root / index_of(root)["weight_map"][name]


def edit_shard(root: Path, name: str, edit) -> None:
    """Rewrite the shard holding `name` after `edit(tensors: dict)`, and keep the index in step."""
    shard = shard_of(root, name)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = index_of(root)
    wm = {k: v for k, v in index["weight_map"].items() if v != shard.name or k in tensors}
    wm.update({k: shard.name for k in tensors})
    index["weight_map"] = wm
    (root / INDEX_FILE).write_text(json.dumps(index))


def assert_cli_error(capsys, root: Path, *needles: str) -> str:
    code, out, err = run_cli(capsys, "inspect", str(root))
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    for n in needles:
        assert n in out + err, (n, out, err)
    return err


def test_clean_checkpoint_reads_tensor_by_tensor(clean_kl):
    reader = open_checkpoint(clean_kl)
    specs = {s.name: s for s in synthetic_specs(reader.config)}
    assert set(reader.tensor_names()) == set(specs)
    assert reader.config.architecture == "Kimi Linear"
    seen = 0
    for name, t in reader.iter_tensors():
        spec = specs[name]
        assert tuple(t.shape) == spec.shape
        assert t.dtype == {"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype]
        assert reader.nbytes(name) == spec.nbytes
        seen += 1
    assert seen == len(specs)
    assert reader.get(LAYER1 + "self_attn.dt_bias").dtype == torch.float32


def test_single_file_checkpoint(clean_kl, tmp_path):
    root = tmp_path / "single"
    root.mkdir()
    shutil.copy(clean_kl / "config.json", root)
    tensors = {}
    for shard in sorted(set(index_of(clean_kl)["weight_map"].values())):
        tensors.update(load_file(clean_kl / shard))
    save_file(tensors, root / "model.safetensors")
    reader = open_checkpoint(root)
    assert reader.files == ["model.safetensors"]
    assert len(reader.tensor_names()) == len(tensors)


def test_header_parse_matches_safetensors(clean_kl):
    shard = shard_of(clean_kl, "model.embed_tokens.weight")
    tensors, problems = read_safetensors_header(shard)
    assert problems == []
    loaded = load_file(shard)
    assert {t.name: list(t.shape) for t in tensors} == {k: list(v.shape) for k, v in loaded.items()}


def test_read_log_hashes_exactly_the_bytes_returned(ckpt):
    """Inside read_log() each read is logged with the sha256 of its stored bytes (slices: just the slice);
    `digest` gives the same value, reads are counted, and the tensor table digest moves with the layout."""
    import hashlib

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()

    with open_checkpoint(ckpt) as reader:
        name = next(n for n in reader.tensor_names() if n.endswith("embed_tokens.weight"))
        file = reader.stored(name).file
        whole = load_file(str(ckpt / file))[name]
        reader.bytes_read = 0
        with reader.read_log() as log:
            assert torch.equal(reader.get_part(name, (0, 2, 5)), whole[2:5])
            reader.get(name)
            with pytest.raises(RuntimeError, match="do not nest"), reader.read_log():
                pass
        assert log == {(file, name, (0, 2, 5)): sha(whole[2:5]), (file, name, None): sha(whole)}
        assert reader.digest(name, (0, 2, 5)) == sha(whole[2:5])
        assert reader.bytes_read == 2 * whole[2:5].numel() * 2 + whole.numel() * 2
        reader.get(name)
        assert len(log) == 2  # nothing is logged outside the block
        layout = reader.layout_digest()
    with open_checkpoint(ckpt) as again:
        assert again.layout_digest() == layout
    tensors = load_file(str(ckpt / file))
    save_file(dict(reversed(list(tensors.items()))), str(ckpt / file))  # same tensors, other offsets
    with open_checkpoint(ckpt) as moved:
        assert moved.layout_digest() != layout


def test_fingerprint_is_stable_and_covers_shards(clean_kl):
    fp = checkpoint_fingerprint(clean_kl)
    shards = set(index_of(clean_kl)["weight_map"].values())
    assert set(fp) == shards | {"config.json", INDEX_FILE}
    assert fp == checkpoint_fingerprint(clean_kl)
    assert all(len(v) == 64 for v in fp.values())


def test_missing_tensor(ckpt, capsys):
    name = LAYER1 + "self_attn.b_proj.weight"
    edit_shard(ckpt, name, lambda t: t.pop(name))
    kinds = [(p.kind, p.name) for p in CheckpointReader(ckpt).validate()]
    assert kinds == [("missing", name)]
    assert_cli_error(capsys, ckpt, "missing", name)


def test_unexpected_tensor(ckpt, capsys):
    name = LAYER1 + "self_attn.bogus.weight"
    edit_shard(ckpt, LAYER1 + "self_attn.b_proj.weight", lambda t: t.update({name: torch.zeros(2, 2)}))
    assert [(p.kind, p.name) for p in CheckpointReader(ckpt).validate()] == [("unexpected", name)]
    assert_cli_error(capsys, ckpt, "unexpected", name)


def test_vision_tensors_are_allowed(ckpt):
    edit_shard(ckpt, "model.norm.weight", lambda t: t.update({"vision_tower.extra.weight": torch.zeros(4)}))
    assert CheckpointReader(ckpt).validate() == []


def test_wrong_shape(ckpt, capsys):
    name = LAYER1 + "self_attn.o_proj.weight"
    edit_shard(ckpt, name, lambda t: t.update({name: t[name][:, :32].contiguous()}))
    problems = CheckpointReader(ckpt).validate()
    assert [(p.kind, p.name) for p in problems] == [("shape", name)]
    assert "[64, 32]" in problems[0].detail
    assert_cli_error(capsys, ckpt, "shape", name, "expected [64, 64]")


def test_wrong_dtype(ckpt, capsys):
    name = LAYER1 + "self_attn.dt_bias"  # a float tensor stored as integers is no float dtype's rounding
    edit_shard(ckpt, name, lambda t: t.update({name: t[name].to(torch.int32)}))
    assert [(p.kind, p.name) for p in CheckpointReader(ckpt).validate()] == [("dtype", name)]
    assert_cli_error(capsys, ckpt, "dtype", name, "expected F32")


def test_other_float_dtypes_are_accepted_and_reported(ckpt):
    """Any float dtype is accepted: an F32 tensor stored BF16 is widened back to F32, a BF16 tensor stored
    F32 or F16 keeps its precision; the reader reports what it did."""
    fp32_name, bf16_name, f16_name, f64_name = (LAYER1 + "self_attn.dt_bias", LAYER1 + "self_attn.o_proj.weight",
                                                LAYER1 + "input_layernorm.weight", LAYER1 + "post_attention_layernorm.weight")
    for name, dtype in ((fp32_name, torch.bfloat16), (bf16_name, torch.float32), (f16_name, torch.float16),
                        (f64_name, torch.float64)):
        edit_shard(ckpt, name, lambda t, name=name, dtype=dtype: t.update({name: t[name].to(dtype)}))
    reader = CheckpointReader(ckpt)
    assert reader.validate() == []
    assert reader.dtype_report() == {"BF16 cast to F32 (expected F32)": 1, "F16 kept (expected BF16)": 1,
                                     "F32 kept (expected BF16)": 1, "F64 cast to F32 (expected BF16)": 1}
    assert [reader.get(n).dtype for n in (fp32_name, bf16_name, f16_name, f64_name)] == [
        torch.float32, torch.float32, torch.float16, torch.float32]


def test_unsupported_stored_dtype(ckpt, capsys):
    shard = shard_of(ckpt, "model.norm.weight")
    data = shard.read_bytes()
    assert data.count(b'"dtype":"BF16"') > 1
    shard.write_bytes(data.replace(b'"dtype":"BF16"', b'"dtype":"XF16"', 1))
    problems = CheckpointReader(ckpt).validate()
    assert [(p.kind, p.file) for p in problems] == [("dtype", shard.name)]
    assert_cli_error(capsys, ckpt, "unsupported safetensors dtype 'XF16'", shard.name)


def test_truncated_shard(ckpt, capsys):
    shard = shard_of(ckpt, LAYER1 + "self_attn.o_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    problems = CheckpointReader(ckpt).validate()
    assert [(p.kind, p.file) for p in problems] == [("truncated", shard.name)]
    reader = CheckpointReader(ckpt)
    with pytest.raises(InputError, match="truncated"):
        reader.get(problems[0].name)
    assert_cli_error(capsys, ckpt, "truncated", shard.name)


def test_header_length_past_end(ckpt, capsys):
    shard = shard_of(ckpt, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:200])
    assert_cli_error(capsys, ckpt, "truncated", shard.name, "header length")


def test_garbage_header(ckpt, capsys):
    shard = shard_of(ckpt, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff\x00garbage, not json at all!!!!!!!"
    shard.write_bytes(bytes(data))
    problems = CheckpointReader(ckpt).validate()
    assert [(p.kind, p.file) for p in problems] == [("corrupt", shard.name)]
    assert_cli_error(capsys, ckpt, "corrupt", shard.name, "not valid JSON")


def test_offsets_past_end_of_file(ckpt, capsys):
    """A header whose last tensor's data_offsets end past EOF (file cut just after that header)."""
    name = "model.norm.weight"
    shard = shard_of(ckpt, name)
    tensors, _ = read_safetensors_header(shard)
    last = max(tensors, key=lambda t: t.end)
    shard.write_bytes(shard.read_bytes()[: last.start + 1])
    assert_cli_error(capsys, ckpt, "truncated", shard.name, last.name)


def test_index_points_to_missing_file(ckpt, capsys):
    shard = shard_of(ckpt, LAYER1 + "self_attn.o_proj.weight")
    shard.unlink()
    problems = CheckpointReader(ckpt).validate()
    assert [(p.kind, p.file) for p in problems] == [("missing_shard", shard.name)]
    assert_cli_error(capsys, ckpt, "missing_shard", shard.name)


def test_corrupt_index(ckpt, capsys):
    (ckpt / INDEX_FILE).write_text("{ not json")
    assert_cli_error(capsys, ckpt, INDEX_FILE, "not valid JSON")


def test_unknown_model_type(ckpt, capsys):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_cli_error(capsys, ckpt, "config.json", "unsupported model_type 'llama'")


def test_inconsistent_layer_lists(ckpt, capsys):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4, 5]  # 4 is also a full-attention layer
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_cli_error(capsys, ckpt, "config.json", "kda_layers", "in both (1-based): [4]")


def test_pickle_only_checkpoint_is_refused(clean_kl, tmp_path, capsys):
    root = tmp_path / "pickled"
    root.mkdir()
    shutil.copy(clean_kl / "config.json", root)
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")  # never unpickled
    with pytest.raises(InputError, match="pickle"):
        CheckpointReader(root)
    assert_cli_error(capsys, root, "pytorch_model.bin", "pickle")


def test_no_weights_at_all(clean_kl, tmp_path, capsys):
    root = tmp_path / "empty"
    root.mkdir()
    shutil.copy(clean_kl / "config.json", root)
    assert_cli_error(capsys, root, "no model.safetensors")


def test_all_problems_in_one_error(ckpt):
    missing = LAYER1 + "self_attn.b_proj.weight"
    edit_shard(ckpt, missing, lambda t: t.pop(missing))
    wrong = "model.layers.4.self_attn.dt_bias"
    edit_shard(ckpt, wrong, lambda t: t.update({wrong: t[wrong].to(torch.int64)}))
    gone = shard_of(ckpt, "model.norm.weight")
    gone.unlink()
    with pytest.raises(InputError) as exc:
        open_checkpoint(ckpt)
    msg = str(exc.value)
    assert "3 problem(s)" in msg
    for needle in (missing, wrong, gone.name, "missing_shard", "dtype"):
        assert needle in msg


def test_console_script_has_no_traceback(ckpt):
    shard = shard_of(ckpt, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:-7])
    exe = Path(sys.executable).with_name("moe-export")
    proc = subprocess.run([str(exe), "inspect", str(ckpt)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert shard.name in proc.stdout + proc.stderr
    assert "error:" in proc.stderr

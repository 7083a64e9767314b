"""The keystone: `moe-export build` engines reproduce the PyTorch reference on the source checkpoint.

Engines are built through the real driver (convert -> graph -> ORT lowering) and run in ONNX Runtime
with all ranks in process (collectives summed in lockstep) and, for the CLI contract, under
`mpiexec -n 4`. Logits must match the fp32 reference within 1e-4 at every step, and greedy tokens
must be identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from moe_export.export.build import build
from moe_export.graphs.model import KimiModel
from moe_export.recipes.schema import load_recipe
from moe_export.runtime.engine import Engine, SequenceChunk, StepBatch

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]
DECODE_STEPS = 8
ATOL = 1e-4


def chunk(slot: int, start: int, tokens: list[int], block_size: int, first_block: int = 0) -> SequenceChunk:
    """A chunk whose block table is the consecutive blocks first_block, first_block + 1, ... it needs."""
    blocks = -(-(start + len(tokens)) // block_size)
    return SequenceChunk(slot, start, tokens, list(range(first_block, first_block + blocks)))


def make_recipe(tmp: Path, preset: str, tp: int, ep: int, world: int, attention: str = "tp",
                kv_cache: str = "fp32") -> Path:
    """tiny-cpu with another model, layout and cache storage dtype (fp32 by default: exact parity)."""
    base = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    base["name"] = f"{preset}-tp{tp}-ep{ep}-w{world}-attn{attention}-kv{kv_cache}"
    base["quantization"]["kv_cache"] = kv_cache
    base["model"] = {"source": f"synthetic:{preset}"}
    base["target"]["gpus_per_node"] = world
    base["parallel"] = {"tp": tp, "ep": ep, "attention": attention}
    path = tmp / f"{base['name']}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Built engine dirs keyed by (preset, tp, ep, world), built once per module."""
    root = tmp_path_factory.mktemp("engines")
    built: dict[tuple, Path] = {}

    def get(preset: str, tp: int, ep: int, world: int, attention: str = "tp", kv_cache: str = "fp32") -> Path:
        key = (preset, tp, ep, world, attention, kv_cache)
        if key not in built:
            rec, _ = load_recipe(make_recipe(root, *key))
            out = root / rec.name
            build(rec, out)
            built[key] = out
        return built[key]

    return get


def source_checkpoint(engine_dir: Path) -> Path:
    """The synthetic source the build generated (deterministic, seed 0)."""
    return next((engine_dir / ".cache").glob("source-*"))


def compare_with_reference(engine_dir: Path) -> list[int]:
    """Prefill + greedy decode with the engine and the reference side by side; returns the tokens."""
    ref = KimiModel.from_checkpoint(source_checkpoint(engine_dir))
    cache = ref.new_cache(1)
    eng = Engine(engine_dir, num_slots=2, threads=1)
    bs = eng.block_size
    eng.reset_slot(1)
    ref_logits = ref.prefill(torch.tensor([PROMPT]), cache)[0, -1]
    logits = eng.step(StepBatch.from_sequences([chunk(1, 0, PROMPT, bs)]))[0]
    tokens = []
    for step in range(DECODE_STEPS + 1):
        np.testing.assert_allclose(logits, ref_logits.numpy(), atol=ATOL, rtol=0, err_msg=f"step {step}")
        token = int(ref_logits.argmax())
        assert int(np.argmax(logits)) == token, f"greedy token differs at step {step}"
        tokens.append(token)
        ref_logits = ref.decode(torch.tensor([token]), cache)[0]
        logits = eng.step(StepBatch.from_sequences([chunk(1, len(PROMPT) + step, [token], bs)]))[0]
    return tokens


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-k3-dsa", "tiny-kimi-linear"])
def test_tp2_ep2_engine_matches_reference(engines, preset):
    compare_with_reference(engines(preset, 2, 2, 4))


@pytest.mark.parametrize("tp, ep, world, attention", [(1, 1, 1, "tp"), (1, 4, 4, "tp"), (2, 2, 4, "dp")])
def test_other_layouts_match_reference(engines, tp, ep, world, attention):
    """World 1, experts over 4 ranks, and data-parallel (replicated) attention with tp=2 FFNs."""
    compare_with_reference(engines("tiny-k3", tp, ep, world, attention))


def test_packed_batch_of_prefill_and_decode(engines):
    """One step mixing a prefill chunk of one sequence with a decode token of another equals running them apart."""
    engine_dir = engines("tiny-k3-dsa", 2, 2, 4)
    eng = Engine(engine_dir, num_slots=3, threads=1)
    bs = eng.block_size
    for s in range(3):
        eng.reset_slot(s)
    a, b = PROMPT[:9], PROMPT[3:]
    alone_a = eng.step(StepBatch.from_sequences([chunk(0, 0, a, bs)]))
    eng.reset_slot(0)
    alone_b = eng.step(StepBatch.from_sequences([chunk(0, 0, b, bs)]))
    eng.reset_slot(0)
    eng.step(StepBatch.from_sequences([chunk(0, 0, a[:-1], bs)]))
    mixed = eng.step(StepBatch.from_sequences([chunk(0, len(a) - 1, a[-1:], bs), chunk(2, 0, b, bs, first_block=1)]))
    np.testing.assert_allclose(mixed[0], alone_a[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(mixed[1], alone_b[0], atol=ATOL, rtol=0)


def test_kimi_linear_engine_matches_transformers(engines):
    from conftest import transformers_without_fla

    engine_dir = engines("tiny-kimi-linear", 2, 2, 4)
    with transformers_without_fla() as transformers:
        hf = transformers.KimiLinearForCausalLM.from_pretrained(source_checkpoint(engine_dir), dtype=torch.float32)
        hf.eval()
        with torch.no_grad():
            want = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
    eng = Engine(engine_dir, num_slots=1, threads=1)
    eng.reset_slot(0)
    got = eng.step(StepBatch.from_sequences([chunk(0, 0, PROMPT, eng.block_size)]))[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_mpiexec_generate_cli_equals_reference(engines):
    """`mpiexec -n 4 moe-export generate OUT --prompt-ids ... --json` (tp=2, ep=2) == reference generate."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    engine_dir = engines("tiny-k3", 2, 2, 4)
    ids = ",".join(map(str, PROMPT))
    cmd = ["moe-export", "generate", "--max-new-tokens", "12", "--prompt-ids", ids, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    eng = subprocess.run([mpiexec, "-n", "4", *cmd[:2], str(engine_dir), *cmd[2:]], capture_output=True, text=True,
                         env=env, timeout=300)
    assert eng.returncode == 0, eng.stderr
    ref = subprocess.run([*cmd[:2], str(source_checkpoint(engine_dir)), *cmd[2:]], capture_output=True, text=True,
                         timeout=300)
    assert ref.returncode == 0, ref.stderr
    lines = [line for line in eng.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, "only rank 0 prints"
    assert json.loads(lines[0]) == json.loads(ref.stdout)
    assert len(json.loads(lines[0])["tokens"]) == 12


class FP8RoundTrip:
    """The source checkpoint with the recipe's FP8 classes' 2-D bf16 weights passed through FP8 block
    quantization (world 1: one shard = the whole tensor), i.e. what an fp8 engine computes with."""

    def __init__(self, reader, classes: set[str]):
        from moe_export.graphs.weights import all_tensor_specs

        self.reader, self.config = reader, reader.config
        self.fp8 = {s.name for s in all_tensor_specs(reader.config, include_experts=False)
                    if s.weight_class in classes and s.dtype == "BF16" and len(s.shape) == 2}

    def get(self, name: str) -> torch.Tensor:
        from moe_export.quantize import fp8

        t = self.reader.get(name)
        return fp8.decode(*fp8.encode(t)) if name in self.fp8 else t  # fp32, as the engine dequantizes


def test_fp8_dense_attention_shared_engine_matches_fp8_reference(tmp_path):
    """quantization dense/attention/shared_experts: fp8 -> FP8 weights + block scales in the rank file,
    dequantized in the graph; equals the reference run on the same FP8-rounded weights."""
    from moe_export.export.checkpoint import open_checkpoint
    from moe_export.export.convert import fp8_weight_classes

    path = make_recipe(tmp_path, "tiny-k3", 1, 1, 1)
    data = yaml.safe_load(path.read_text())
    data["quantization"].update(dense="fp8", attention="fp8", shared_experts="fp8")
    path.write_text(yaml.safe_dump(data))
    rec, _ = load_recipe(path)
    out = tmp_path / "fp8"
    build(rec, out)
    header = json.loads((out / "rank0" / "quantization.json").read_text())
    assert any(t["fmt"] == "fp8_block128" for t in header["tensors"])
    ref = KimiModel.from_source(FP8RoundTrip(open_checkpoint(source_checkpoint(out)), fp8_weight_classes(rec)))
    cache = ref.new_cache(1)
    eng = Engine(out, num_slots=1, threads=1)
    eng.reset_slot(0)
    want = ref.prefill(torch.tensor([PROMPT]), cache)[0, -1].numpy()
    got = eng.step(StepBatch.from_sequences([chunk(0, 0, PROMPT, eng.block_size)]))[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)

"""Sampling filters, generation with the reference model, and the `generate` command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import run_cli
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.generate import (
    ReferenceEngine,
    generate_tokens,
    reference_generate,
)
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.tokenizer import load_tokenizer


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 1.5},
                                {"top_logprobs": 21}, {"repetition_penalty": 0.0}, {"presence_penalty": 3.0},
                                {"min_tokens": 300}, {"logit_bias": {"x": 1}}, {"seed": 1.5}])
def test_bad_sampling_params(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)


def test_model_defaults_come_from_generation_config():
    from moe_export.runtime.sampling import model_defaults

    assert model_defaults(None) == SamplingParams()
    got = model_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 3})
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (0.6, 0.95, 20, 0.0)
    assert model_defaults({"do_sample": False, "temperature": 0.6}).greedy
    with pytest.raises(InputError):
        model_defaults({"temperature": "hot"})
    with pytest.raises(InputError):
        model_defaults({"top_p": 2.0})


def test_from_flags():
    """Flags over the engine's defaults: greedy defaults stay greedy, top-k / top-p alone sample at temperature 1;
    sampling defaults (generation_config.json) stay unless a flag replaces them."""
    from moe_export.runtime.sampling import model_defaults

    greedy = SamplingParams()
    assert SamplingParams.from_flags(greedy).greedy
    assert SamplingParams.from_flags(greedy, top_k=5) == SamplingParams(temperature=1.0, top_k=5, max_tokens=256)
    assert SamplingParams.from_flags(greedy, temperature=0.7, top_p=0.9, seed=4) == SamplingParams(0.7, 0, 0.9, 4)
    model = model_defaults({"temperature": 0.6, "top_p": 0.95})
    assert SamplingParams.from_flags(model, max_tokens=7) == SamplingParams(0.6, 0, 0.95, None, 7)
    assert SamplingParams.from_flags(model, top_k=3).temperature == 0.6
    assert SamplingParams.from_flags(model, temperature=0).greedy


@pytest.fixture(scope="module")
def k3(synthetic_checkpoint):
    path = synthetic_checkpoint("tiny-k3")
    return path, load_model(path)


def test_greedy_generate_equals_argmax_of_full_forward(k3):
    _, model = k3
    prompt = [5, 17, 200, 3, 99]
    got = reference_generate(model, prompt, 6, stop_at_eos=False)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt) :]


def test_generate_stops_after_a_stop_id_and_eos(k3):
    """The loop ends right after a stop id or an eos id (included), not before, not later."""
    _, model = k3
    free = reference_generate(model, [1, 2, 3], 8, stop_at_eos=False)
    i = next(i for i in range(1, 8) if free[i] not in free[:i])
    stop = SamplingParams(max_tokens=8, stop_token_ids=(free[i],))
    assert generate_tokens(ReferenceEngine(model), [1, 2, 3], stop) == free[: i + 1]
    assert generate_tokens(ReferenceEngine(model), [1, 2, 3], SamplingParams(max_tokens=8), [free[i]]) == free[: i + 1]
    ignore = SamplingParams(max_tokens=8, ignore_eos=True)
    assert generate_tokens(ReferenceEngine(model), [1, 2, 3], ignore, [free[i]]) == free


def cli_reference(model, tok, ids: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    """What `moe-export generate` on a checkpoint computes, as LLM does on an engine: the stop ids of the model and
    its tokenizer, only ids the tokenizer decodes sampled."""
    params = dataclasses.replace(sampling or SamplingParams(), max_tokens=n)
    eos = sorted(set(model.cfg.eos_token_ids) | set(tok.eos_token_ids))
    return generate_tokens(ReferenceEngine(model), ids, params, eos, sample_vocab=tok.vocab_size)


def test_cli_generate_json_and_text(k3, capsys):
    path, model = k3
    tok = load_tokenizer(path)
    rc, out, _ = run_cli(capsys, "generate", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json")
    assert rc == 0
    tokens = json.loads(out)["tokens"]
    assert tokens == cli_reference(model, tok, [1, 2, 3], 5) and max(tokens) < tok.vocab_size

    rc, out, _ = run_cli(capsys, "generate", str(path), "--prompt", "Hi there", "--max-new-tokens", "4")
    assert rc == 0
    assert out == tok.decode(cli_reference(model, tok, tok.encode("Hi there"), 4)) + "\n"

    args = ("generate", str(path), "--prompt-ids", "4,5", "--max-new-tokens", "6", "--top-p", "0.9", "--seed", "11", "--json")
    first, second = run_cli(capsys, *args)[1], run_cli(capsys, *args)[1]
    assert first == second
    sampled = cli_reference(model, tok, [4, 5], 6, SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    assert json.loads(first)["tokens"] == sampled


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt-ids", "1,x"), "not an integer"),
        (("--prompt-ids", "1,2.5"), "not an integer"),
        (("--prompt-ids", "1,100000"), "outside the vocabulary"),
        (("--prompt-ids", "-3"), "outside the vocabulary"),
        (("--prompt-ids", ""), "not an integer"),
        (("--prompt-ids", "1", "--prompt", "a"), "exactly one"),
        ((), "exactly one"),
        (("--prompt-ids", "1", "--top-p", "0"), "top_p"),
        (("--prompt-ids", "1", "--seed", "18446744073709551616"), "an unsigned 64-bit integer"),
        (("--prompt-ids", "1", "--seed", "-1"), "an unsigned 64-bit integer"),
        (("--prompt-ids", "1", "--top-k", str(1 << 63)), "top_k must be within the 64-bit integer range"),
        (("--prompt-ids", "1", "--temperature", "nan"), "temperature must be a finite number"),
        (("--prompt-ids", "1,530"), "outside the vocabulary [0, 528)"),  # the model knows 576 ids, the tokenizer 528
    ],
)
def test_cli_generate_bad_input_exits_2(k3, capsys, args, message):
    rc, _, err = run_cli(capsys, "generate", str(k3[0]), *args, "--max-new-tokens", "2")
    assert rc == 2
    assert message in err


def test_generate_refuses_a_checkpoint_too_large_for_memory(tmp_path, capsys):
    """K3's config alone (no weights): refused up front, naming the fp32 memory it would need (~10 TiB)."""
    from moe_export.common.model_config import shipped_model_config
    from moe_export.export.plan.planner import GIB, reference_fp32_bytes
    from moe_export.recipes import models_dir

    (tmp_path / "config.json").write_bytes((models_dir() / "kimi-k3.json").read_bytes())
    need = reference_fp32_bytes(shipped_model_config("kimi-k3"))
    assert 2.7e12 * 4 < need < 2.9e12 * 4  # 2.78 T parameters
    code, out, err = run_cli(capsys, "generate", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert code == 2 and "Traceback" not in err
    assert f"{need / GIB:,.1f} GiB" in err.replace("\n", "") and "moe-export build" in err.replace("\n", "")


def test_generate_refuses_when_available_memory_is_short(k3, capsys, monkeypatch):
    from moe_export.export.plan import planner

    monkeypatch.setattr(planner, "available_memory_bytes", lambda: 1 << 20)
    code, _, err = run_cli(capsys, "generate", str(k3[0]), "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert code == 2 and "0.0 GiB are available" in err.replace("\n", "")

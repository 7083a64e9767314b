"""The sampler's GPU kernels (`runtime.engine.sampler_kernels`) under Triton's interpreter on CPU: the fused
argmax equals torch.argmax exactly (ties: the lowest index); the rejection-sampling draw, called as the GPU path
calls it (`sampler._draw_kernel`), draws only tokens of the kept set (the definition with a full sort, from
test_sampler) and in its renormalized proportions (Pearson's chi-square, p > 1e-3), with per-row seeds: a row
draws the same token alone or in a batch, and the same as the CPU path."""

from __future__ import annotations

import pytest
import torch
from conftest import run_triton_inner_tests
from test_sampler import SMALL, batch, chi_square_p, kept_probs


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


def draw_kernel(logits: torch.Tensor, sb) -> torch.Tensor:
    """The GPU path's draw (`sampler._draw_kernel`) on CPU tensors: ids [R] for every row of logits [R, V]."""
    from moe_export.runtime.engine.sampler import _draw_kernel

    x = logits.clone()
    return _draw_kernel(x, sb, sb, torch.arange(x.shape[0]))


@inner_triton
@pytest.mark.parametrize("block", [128, 4096])
def test_inner_triton_argmax_equals_torch(block):
    from moe_export.runtime.engine.sampler_kernels import argmax_rows

    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    x[1, 3] = x[1, 700] = x[1, 999] = 50.0  # ties in different blocks: the lowest index
    x[2] = float("-inf")  # nothing allowed: index 0, as torch
    x[3, 500:] = float("-inf")
    x[4, 129] = x[4, 130] = 60.0  # a tie inside one lane's neighbourhood
    assert torch.equal(argmax_rows(x, block=block), x.argmax(dim=1))


@inner_triton
@pytest.mark.parametrize("kw", [{"top_p": 0.78}, {"temperature": 1.5, "top_k": 6, "top_p": 0.9, "min_p": 0.1},
                                {"top_k": 3, "min_p": 0.2}])
def test_inner_triton_draws_follow_the_kept_distribution(kw):
    n = 500
    ids = draw_kernel(SMALL.expand(n, -1), batch(n, seed=torch.arange(n, dtype=torch.long) * 31 + 5, **kw))
    counts = torch.bincount(ids, minlength=SMALL.shape[0])
    assert chi_square_p(counts, kept_probs(SMALL, **kw)) > 1e-3  # asserts membership too


@inner_triton
def test_inner_triton_nucleus_over_several_blocks_seeded():
    """2,600 tokens (three blocks, the last partial), 40 likely ones spread over the row, top-p 0.8 (about a
    fifth of the proposals rejected): every draw lies in the nucleus; rows draw the same alone, in the batch and
    on the CPU path (same uniforms; only float rounding could move a draw)."""
    from moe_export.runtime.engine.sampler import draw_keys, sample
    from moe_export.runtime.engine.sampler_kernels import sample_rows

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2600, generator=gen) * 0.5 - 6
    hot = torch.randperm(2600, generator=gen)[:40]
    logits[hot] = torch.randn(40, generator=gen) * 0.5 + 2
    nucleus = kept_probs(logits, top_p=0.8) > 0
    n = 60
    x = logits.expand(n, -1).contiguous()
    seed, counter = torch.arange(n, dtype=torch.long) + 40, torch.arange(n, dtype=torch.long) % 7

    def draw(rows: slice) -> torch.Tensor:
        m = x[rows].shape[0]
        return sample_rows(x[rows], torch.ones(m), torch.zeros(m, dtype=torch.long), torch.full((m,), 0.8),
                           torch.zeros(m), draw_keys(seed[rows], counter[rows]))  # fmt: skip

    together = draw(slice(0, n))
    assert bool(nucleus[together].all())
    assert len(set(together.tolist())) > 10
    assert [int(draw(slice(i, i + 1))[0]) for i in (0, 57, n - 1)] == [int(together[i]) for i in (0, 57, n - 1)]
    on_cpu = sample(x.clone(), batch(n, top_p=0.8, seed=seed, counter=counter)).ids
    assert (torch.from_numpy(on_cpu) == together).float().mean() >= 0.97


@inner_triton
def test_inner_triton_pivot_rounds_follow_the_kept_distribution():
    """A flat row of 64 tokens at top-p 0.1 (4 tokens kept): a proposal is kept with probability ~0.1, so
    all 8 of a pass are rejected in ~40 % of the rows and those rows go on from the pivot (later passes, their
    proposals above it and checked in the pass after): the draws still follow the kept distribution
    (chi-square, p > 1e-3: a correct sampler fails with probability 1e-3 over the choice of seeds)."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(11)) * 0.3
    n = 400
    ids = draw_kernel(logits.expand(n, -1), batch(n, top_p=0.1, seed=torch.arange(n, dtype=torch.long) * 17 + 1))
    counts = torch.bincount(ids, minlength=64)
    want = kept_probs(logits, top_p=0.1)
    assert int((want > 0).sum()) == 4
    assert chi_square_p(counts, want) > 1e-3


@inner_triton
def test_inner_triton_top_p_reads_each_logit_at_most_twice(monkeypatch):
    """Passes over the logits, counted as the kernel's loads of each row under the interpreter (the GPU path,
    `sampler._draw_kernel`, no torch pass over the rows either: no top-k mask unless top-k and top-p meet): a
    top-p row, alone or with min-p, temperature or a top-k at or above the vocabulary, reads each of its
    3,000 logits (three blocks) exactly twice: pass 0 finds the max, the sum and 8 proposals, pass 1 checks
    them (a third pass needs all 8 outside the top-p set: probability (1 - 0.9)^8 here); a row with temperature
    alone reads them once."""
    import numpy as np
    from triton.runtime import interpreter

    from moe_export.runtime.engine.sampler import _draw_kernel

    x = (torch.randn(8, 3000, generator=torch.Generator().manual_seed(12)) * 2).contiguous()
    lo, row_bytes = x.data_ptr(), x.stride(0) * x.element_size()
    reads = np.zeros(8, dtype=np.int64)
    load = interpreter.interpreter_builder.create_masked_load

    def counting_load(ptrs, mask, other, *args):
        addr = ptrs.data.astype(np.int64) - lo
        hit = mask.data.astype(bool) & (addr >= 0) & (addr < 8 * row_bytes)
        np.add.at(reads, addr[hit] // row_bytes, 1)
        return load(ptrs, mask, other, *args)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_masked_load", counting_load)
    sb = batch(8, top_p=torch.tensor([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 1.0, 1.0]),
               temperature=torch.tensor([1.0, 1.0, 0.7, 1.3, 1.0, 1.0, 1.0, 0.8]),
               min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0]),
               top_k=torch.tensor([0, 0, 0, 0, 0, 3000, 0, 0]))  # fmt: skip
    ids = _draw_kernel(x, sb, sb, torch.arange(8))
    assert bool((ids >= 0).all())
    assert (reads // 3000).tolist() == [2, 2, 2, 2, 2, 2, 1, 1] and bool((reads % 3000 == 0).all())


def test_kernels_compile_for_hopper():
    """Both kernels compile for sm_90 (the H200) at the block size the runtime launches, no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget

    from moe_export.runtime.engine import sampler_kernels as sk

    rows = dict(x_ptr="*fp32", stride="i32")
    cases = [(sk._argmax_kernel, dict(**rows, out_ptr="*i64", V="i32"), dict(BLOCK=sk.ARGMAX_BLOCK), sk.ARGMAX_WARPS),
             (sk._sample_kernel, dict(**rows, t_ptr="*fp32", k_ptr="*i64", p_ptr="*fp32", min_p_ptr="*fp32",
                                      key_ptr="*i64", out_ptr="*i64", V="i32"),
              dict(ROUNDS=sk.ROUNDS, K=sk.PROPOSALS, BLOCK=sk.BLOCK), sk.WARPS)]  # fmt: skip
    for fn, signature, constexprs, warps in cases:
        signature.update({name: "constexpr" for name in constexprs})
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert ".entry" in compiled.asm["ptx"] and compiled.asm["cubin"]


@inner_triton
def test_inner_triton_guards_masked_rows_and_out_of_range_top_k():
    """The draw kernel guards itself: a row whose logits are all -inf gets -1 (no NaN weight is formed), the
    other rows draw as alone; a top_k above the vocabulary is no filter (the same draws as top_k 0)."""
    from moe_export.runtime.engine.sampler import draw_keys
    from moe_export.runtime.engine.sampler_kernels import sample_rows

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    x[1] = float("-inf")
    seed, counter = torch.tensor([3, 4, 5]), torch.zeros(3, dtype=torch.long)

    def draw(rows, top_k):
        m = len(rows)
        return sample_rows(x[rows].contiguous(), torch.ones(m), torch.full((m,), top_k), torch.full((m,), 0.9),
                           torch.zeros(m), draw_keys(seed[rows], counter[rows]))  # fmt: skip

    together = draw([0, 1, 2], 0)
    assert together[1] == -1 and together[0] == draw([0], 0)[0] and together[2] == draw([2], 0)[0]
    assert torch.equal(draw([0, 1, 2], 301), together)


class OnDevice(torch.Tensor):
    """A CPU tensor standing in for one on the GPU (ops on it give OnDevice tensors): every call that would make
    the host wait for the device is recorded in `waits`: a read-back (`item`, `tolist`, `cpu`, `numpy`, `bool`,
    `int`, `float`), an op whose output size depends on values (`nonzero`, boolean-mask indexing) or a
    blocking `.to()` copy."""

    waits: list[str] = []
    _READBACK = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "argwhere", "masked_select", "unique", "bincount"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in cls._READBACK:
            cls.waits.append(name)
        elif name == "to" and not kwargs.get("non_blocking", False):
            cls.waits.append("blocking to")
        elif name in ("__getitem__", "__setitem__"):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                cls.waits.append(f"{name} with a boolean mask")
        return super().__torch_function__(func, types, args, kwargs)


@inner_triton
def test_inner_triton_sample_waits_for_nothing(monkeypatch):
    """`sample` on the kernel path (the GPU's, run here on CPU tensors that stand for device ones: the logits and
    the batch as `SamplingBatch.to` moves it) makes no host wait: greedy, sampled, forced and masked rows, top-k,
    top-p, penalties, bias, bans and logprobs; the ids, errors and logprobs come from its asynchronous copies
    when first read, equal to the same call on plain tensors. torch.cuda.synchronize is counted too."""
    from moe_export.runtime.engine import sampler

    monkeypatch.setattr(sampler, "_use_kernels", lambda x: True)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=gen)
    sb = batch(6, temperature=torch.tensor([0.0, 1.0, 0.7, 0.0, 1.0, 1.0]), top_k=torch.tensor([0, 5, 0, 0, 400, 0]),
               top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0, 1.0]), forced=torch.tensor([-1, -1, -1, 7, -1, -1]),
               logprobs=torch.tensor([2, -1, 0, -1, 3, -1]), repetition_penalty=torch.full((6,), 1.3),
               presence_penalty=torch.full((6,), 0.2), frequency_penalty=torch.full((6,), 0.1),
               seen=(torch.tensor([1, 1]), torch.tensor([4, 9])),
               output_counts=(torch.tensor([1]), torch.tensor([4]), torch.tensor([2.0])),
               logit_bias=(torch.tensor([2]), torch.tensor([11]), torch.tensor([3.0])),
               banned=(torch.full((300,), 5), torch.arange(300)))  # row 5: every token banned
    want = sampler.sample(logits.clone(), sb)
    want = (want.ids.tolist(), want.logprobs, want.top_logprobs, want.errors)
    moved = sampler.SamplingBatch.to

    def to_device(self, device):
        out = moved(self, device)
        for name, value in out.__dict__.items():
            if isinstance(value, torch.Tensor):
                setattr(out, name, value.as_subclass(OnDevice))
            elif isinstance(value, tuple):
                setattr(out, name, tuple(v.as_subclass(OnDevice) for v in value))
        return out

    monkeypatch.setattr(sampler.SamplingBatch, "to", to_device)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: OnDevice.waits.append("synchronize"))
    OnDevice.waits.clear()
    out = sampler.sample(logits.clone().as_subclass(OnDevice), sb)
    assert OnDevice.waits == []
    assert (out.ids.tolist(), out.logprobs, out.top_logprobs, out.errors) == want
    assert set(want[3]) == {5} and want[0][3] == 7 and want[0][0] == int(logits[0].argmax())

"""The runner's batched sampler (`runtime.engine.sampler`): the kept sets and frequencies against the definitions
(computed here with a full sort, and torch's regularized incomplete gamma for the chi-square p-value), seeds,
penalties, bias, bans, grammar bitmasks, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from moe_export.runtime.core.structured import pack_bits
from moe_export.runtime.engine.sampler import SamplingBatch, sample


def batch(n: int, **kw) -> SamplingBatch:
    fields = dict(rows=torch.arange(n), temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long),
                  top_p=torch.ones(n), min_p=torch.zeros(n), seed=torch.arange(n, dtype=torch.long) * 7919 + 3,
                  counter=torch.zeros(n, dtype=torch.long), forced=torch.full((n,), -1), logprobs=torch.full((n,), -1))
    extra = {}
    for k, v in kw.items():
        if k in fields:
            fields[k] = v if isinstance(v, torch.Tensor) else torch.full((n,), v, dtype=fields[k].dtype)
        else:
            extra[k] = v
    return SamplingBatch(**fields, **extra)


def kept_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The definition, with a full sort: top-k, then the smallest most-likely prefix of the top-k distribution
    holding top_p, then min-p relative to the most likely token; renormalized."""
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    p = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
    sorted_p = p[order]
    before = sorted_p.cumsum(0) - sorted_p
    keep[order[before >= top_p]] = False
    keep &= p >= min_p * p.max()
    q = p * keep
    return q / q.sum()


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `expected_p` (cells with zero expectation must be empty)."""
    n = counts.sum().double()
    support = expected_p > 0
    assert counts[~support].sum() == 0, "a token outside the kept set was drawn"
    exp = expected_p[support].double() * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw_counts(logits_row: torch.Tensor, draws: int, chunk: int = 2000, **kw) -> torch.Tensor:
    counts = torch.zeros(logits_row.shape[0], dtype=torch.long)
    for start in range(0, draws, chunk):
        n = min(chunk, draws - start)
        sb = batch(n, seed=torch.arange(start, start + n, dtype=torch.long), **kw)
        ids = torch.from_numpy(sample(logits_row.expand(n, -1).clone(), sb).ids)
        counts += torch.bincount(ids, minlength=logits_row.shape[0])
    return counts


SMALL = torch.tensor([0.35, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02]).log()


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.78}, {"min_p": 0.2},
                                {"temperature": 1.5, "top_k": 6, "top_p": 0.9, "min_p": 0.1}])
def test_frequencies_follow_the_kept_distribution(kw):
    """20,000 seeded draws (seeds 0..19,999) against the float64 definition (`kept_probs`): Pearson's chi-square
    p > 1e-3, so a sampler exact in distribution fails a case with probability 1e-3 over the choice of seeds
    (6e-3 for the six); the seeds are fixed, so the outcome is too."""
    counts = draw_counts(SMALL, 20000, **kw)
    assert chi_square_p(counts, kept_probs(SMALL, **kw)) > 1e-3


def test_flat_rows_stay_exact():
    """2,000 near-uniform logits: the top-p set is most of the row; every draw lies in the set and the
    frequencies (in 20 bins) follow it."""
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 0.5
    want = kept_probs(logits, top_p=0.9)
    assert (want > 0).sum() > 1000
    counts = draw_counts(logits, 20000, top_p=0.9)
    assert counts[want == 0].sum() == 0
    bins = torch.arange(2000) // 100
    binned_counts = torch.zeros(20, dtype=torch.long).index_add_(0, bins, counts)
    binned_p = torch.zeros(20, dtype=torch.float64).index_add_(0, bins, want)
    assert chi_square_p(binned_counts, binned_p) > 1e-3


def test_pivot_rounds_stay_exact():
    """A flat row of 3,000 tokens at top-p 0.05 (about 110 tokens kept): each proposal is kept with probability
    ~0.05, so most rows reject all 8 of the first pass and go on from the pivot, often for several passes; the
    draws lie in the set and follow it (chi-square over its tokens, p > 1e-3)."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 0.5
    want = kept_probs(logits, top_p=0.05)
    assert 50 < int((want > 0).sum()) < 200
    counts = draw_counts(logits, 20000, top_p=0.05)
    assert chi_square_p(counts, want) > 1e-3


def test_top_p_nucleus_over_several_blocks_and_a_tail():
    """A vocabulary of 2,600 (two inverse-CDF blocks and a 552-token tail) with 40 likely tokens spread over
    all three: a token outside the top-p nucleus is never drawn, the nucleus is drawn in proportion to the
    renormalized probabilities (chi-square over its tokens), and about a fifth of the first draws are rejected
    (top_p 0.8), so later rounds are exercised; each row draws the same alone and in the batch."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2600, generator=gen) * 0.5 - 6
    hot = torch.randperm(2600, generator=gen)[:40]
    assert (hot < 1024).any() and ((hot >= 1024) & (hot < 2048)).any() and (hot >= 2048).any()
    logits[hot] = torch.randn(40, generator=gen) * 0.5 + 2
    want = kept_probs(logits, top_p=0.8)
    nucleus = want > 0
    assert 5 < int(nucleus.sum()) < 40 and bool(nucleus[hot].sum() == nucleus.sum())
    counts = draw_counts(logits, 20000, top_p=0.8)
    assert counts[~nucleus].sum() == 0
    assert chi_square_p(counts, want) > 1e-3
    rows = logits.expand(8, -1).clone() + torch.randn(8, 2600, generator=gen) * 0.1
    sb = batch(8, top_p=0.8, seed=torch.arange(8) + 40)
    together = sample(rows.clone(), sb).ids.tolist()
    alone = [sample(rows[i:i + 1].clone(), batch(1, top_p=0.8, seed=torch.tensor([40 + i]))).ids[0] for i in range(8)]
    assert together == alone


def test_acceptance_mass_sums_strictly_above_the_pivot():
    """The top-p acceptance mass of the CPU path sums each row's weights strictly above its pivot (a weight
    equal to the pivot is left out)."""
    from moe_export.runtime.engine.sampler import _mass_above

    p = torch.rand(5, 3000, generator=torch.Generator().manual_seed(4))
    ps = p[:, 7].clone()
    want = torch.tensor([float(row[row > v].double().sum()) for row, v in zip(p, ps)], dtype=torch.float64)
    torch.testing.assert_close(_mass_above(p, ps).double(), want, rtol=1e-5, atol=0)


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen)
    seeds, counters = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 3, 1, 9, 2, 4])
    kw = dict(top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 0.7]), top_k=torch.tensor([0, 0, 5, 40, 0, 0]))
    together = sample(logits.clone(), batch(6, seed=seeds, counter=counters, **kw)).ids.tolist()
    alone = [sample(logits[i:i + 1].clone(), batch(1, seed=seeds[i:i + 1], counter=counters[i:i + 1],
                                                    **{k: v[i:i + 1] for k, v in kw.items()})).ids[0] for i in range(6)]
    assert together == alone
    shuffled = torch.tensor([3, 0, 5, 1, 4, 2])
    again = sample(logits[shuffled].clone(), batch(6, seed=seeds[shuffled], counter=counters[shuffled],
                                                   **{k: v[shuffled] for k, v in kw.items()})).ids.tolist()
    assert again == [together[i] for i in shuffled.tolist()]
    other_seed = sample(logits.clone(), batch(6, seed=seeds + 1000, counter=counters, **kw)).ids.tolist()
    assert other_seed != together


def test_greedy_rows_mixed_with_sampled_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    out = sample(logits.clone(), batch(4, temperature=torch.tensor([0.0, 1.0, 0.0, 2.0])))
    assert out.ids[0] == logits[0].argmax() and out.ids[2] == logits[2].argmax()


def test_penalties_bias_bans_and_vocab_limit():
    x = torch.tensor([[4.0, 3.0, -1.0, 0.5, 2.0]])
    sb = batch(1, temperature=0.0, repetition_penalty=torch.tensor([2.0]),
               presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
               seen=(torch.tensor([0, 0]), torch.tensor([0, 2])),
               output_counts=(torch.tensor([0]), torch.tensor([1]), torch.tensor([2.0])))
    from moe_export.runtime.engine.sampler import process_logits

    got = process_logits(x.clone(), sb, {})
    # token 0: 4 / 2; token 2: -1 * 2; token 1: 3 - 0.5 - 2 * 0.25
    torch.testing.assert_close(got, torch.tensor([[2.0, 2.0, -2.0, 0.5, 2.0]]))
    assert sample(x.clone(), batch(1, temperature=0.0, logit_bias=(torch.tensor([0]), torch.tensor([3]),
                                                                   torch.tensor([10.0])))).ids[0] == 3
    assert sample(x.clone(), batch(1, temperature=0.0, banned=(torch.tensor([0, 0]), torch.tensor([0, 1])))).ids[0] == 4
    assert sample(x.clone(), batch(1, temperature=0.0, vocab=0 + 2, banned=(torch.tensor([0]), torch.tensor([0])))).ids[0] == 1


def test_grammar_bitmask_rows_and_forced_tokens():
    x = torch.zeros(3, 70)
    x[:, 5] = 10.0
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[40, 66]] = True
    mask = pack_bits(allowed, 3)[None]
    sb = batch(3, temperature=torch.tensor([0.0, 1.0, 0.0]), bitmask=mask.expand(2, -1).contiguous(),
               bitmask_rows=torch.tensor([1, 2]), forced=torch.tensor([-1, -1, 9]))
    out = sample(x.clone(), sb)
    assert out.ids[0] == 5 and out.ids[1] in (40, 66) and out.ids[2] == 9 and not out.errors


def test_nothing_allowed_and_failing_processors_are_row_errors():
    x = torch.zeros(2, 8)

    def broken(logits):
        raise RuntimeError("boom")

    out = sample(x.clone(), batch(2, temperature=0.0, processors=[(1, broken)],
                                  banned=(torch.zeros(8, dtype=torch.long), torch.arange(8))))
    assert set(out.errors) == {0, 1} and "boom" in out.errors[1] and "masked" in out.errors[0]


def test_logprobs_and_top_logprobs_come_from_the_processed_logits_before_temperature():
    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    out = sample(x.clone(), batch(2, temperature=torch.tensor([0.0, 0.5]), logprobs=torch.tensor([3, -1])))
    lp = torch.log_softmax(x[0], 0)
    assert out.logprobs[0] == pytest.approx(float(lp[out.ids[0]]), abs=1e-5) and out.logprobs[1] is None
    top = lp.topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_top_k_at_or_above_the_vocabulary_filters_nothing():
    """top_k 577 (or 576) over a vocabulary of 576 (a request that once ended a whole mpiexec world with
    `selected index k out of range`) draws exactly what no top-k draws, alone and with top-p."""
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(6))
    for top_p in (1.0, 0.9):
        want = sample(x.clone(), batch(5, top_p=top_p)).ids.tolist()
        for top_k in (576, 577, 1 << 40):
            assert sample(x.clone(), batch(5, top_k=top_k, top_p=top_p)).ids.tolist() == want


def test_top_p_below_the_smallest_representable_mass_keeps_the_top_token():
    """top_p 1e-300 is 0 in fp32 (no token's mass is below it): the most likely token alone is kept, as the
    definition's smallest prefix holding top_p; a tiny positive fp32 top_p keeps it too."""
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(7))
    for top_p in (1e-300, 1e-44, 0.0):
        assert sample(x.clone(), batch(6, top_p=top_p)).ids.tolist() == x.argmax(dim=1).tolist()

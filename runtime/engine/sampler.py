"""Batched sampling inside the runner: one vectorized torch pass over the step's logits [N, V], on the device
the logits were computed on (CPU for ONNX Runtime and the reference model, the GPU for TensorRT); only token
ids (and the logprobs asked for) leave it.

Per row, in this order: the vocabulary limit (ids past the tokenizer), request logits processors (Python
callables; the row alone goes to the host on a GPU), repetition / presence / frequency penalties, logit bias,
banned ids (eos before min_tokens), the grammar bitmask (xgrammar's layout: int32 words, bit j of word i
allows token 32 i + j), then the chosen token's logprob and top logprobs from the log-softmax of these
processed logits (before temperature); then temperature 0 -> argmax, else temperature -> top-k -> min-p ->
top-p and a draw. A forced token (thinking budget) replaces the draw.

Top-p needs no full sort. The top 128 candidates of each row are taken (a partial sort); a row whose
candidates hold the top-p mass (and its whole top-k) samples among them alone. Other rows (flat
distributions) sample from the whole row by inverse CDF in index order, then accept the draw when the mass
of the tokens strictly more likely than it is below top_p, i.e. when it lies in the top-p set; a rejected
draw drops every token no more likely than itself and draws again (the dropped tokens are all outside the
set, so the accepted draw follows the renormalized top-p distribution exactly; acceptance >= top_p per round).

Randomness is counter-based: a row's uniform numbers are a hash (splitmix64) of (its request's seed, the
index of the token in its output, the draw round), so a request draws the same tokens alone or in any batch,
on any device; the core gives unseeded requests a random seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

CANDIDATES = 128  # top candidates per row tried before the whole-row top-p path

_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@dataclass
class SamplingBatch:
    """What the runner needs to choose the step's tokens, as host tensors (R rows sampled of the step's N).

    rows [R]: the step's sequences that get a token (their last chunk reached the end of their tokens), in
    order. Per row: temperature, top_k (0: off), top_p, min_p, seed, counter (the token's index in its
    output), forced (-1: sample), logprobs (-1: none, else how many top logprobs, 0..20). Penalties: rows with
    any, their repetition / presence / frequency values, and the (row, token, count) triples of their output
    tokens (repetition also counts prompt tokens: `seen`). logit_bias and banned: (row, token[, value]).
    bitmask [G, W] int32 for rows `bitmask_rows` [G]. processors: (row, fn(logits [V] fp32) -> logits).
    vocab: ids at or past it are never chosen."""

    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    forced: torch.Tensor
    logprobs: torch.Tensor
    vocab: int | None = None
    penalty_rows: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    output_counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, token, count)
    seen: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, token) of prompt + output tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
    processors: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)

    def to(self, device: torch.device) -> SamplingBatch:
        moved = {}
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
            elif isinstance(value, tuple):
                value = tuple(v.to(device, non_blocking=True) for v in value)
            moved[name] = value
        return SamplingBatch(**moved)


@dataclass
class SampledTokens:
    """The chosen ids [R] (host); for rows that asked, their logprob and top logprobs; errors: rows that got
    no token (a logits processor failed, or every token was masked) -> why."""

    ids: np.ndarray
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    errors: dict[int, str] = field(default_factory=dict)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, round_: int) -> torch.Tensor:
    """[R] float64 in [0, 1): splitmix64 of (seed, counter, round), 53 random bits each."""
    x = seed * _GOLDEN + counter * _MIX1 + torch.full_like(seed, round_ + 1) * _MIX2
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def _mask_rows(x: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """x[rows] = where(keep, x[rows], -inf), in place."""
    x[rows] = x[rows].masked_fill(~keep, float("-inf"))


def process_logits(x: torch.Tensor, sb: SamplingBatch, errors: dict[int, str]) -> torch.Tensor:
    """Everything before temperature, in place on x [R, V] fp32; a failing processor's row goes to `errors`."""
    if sb.vocab is not None and sb.vocab < x.shape[1]:
        x[:, sb.vocab:] = float("-inf")
    width = x.shape[1] if sb.vocab is None else min(sb.vocab, x.shape[1])
    for r, fn in sb.processors:  # each sees the row's sampled width (the tokenizer's ids)
        try:
            row = fn(x[r, :width].cpu() if x.is_cuda else x[r, :width].clone())
            if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.shape[0] != width:
                raise ValueError(f"a logits processor must return a 1-D tensor of logits [{width}]")
        except Exception as exc:  # a request-supplied processor: its failure ends that request only
            errors[r] = f"{type(exc).__name__}: {exc}"
            continue
        x[r, :width] = row.to(x.device)
    if sb.penalty_rows is not None:
        if sb.seen is not None:  # repetition: positive logits divided, negative ones multiplied
            r, t = sb.seen
            vals = x[r, t]
            pen = sb.repetition[r]
            x[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
        if sb.output_counts is not None:
            r, t, c = sb.output_counts
            x.index_put_((r, t), -(sb.frequency[r] * c + sb.presence[r]), accumulate=True)
    if sb.logit_bias is not None:
        r, t, v = sb.logit_bias
        x.index_put_((r, t), v, accumulate=True)
    if sb.banned is not None:
        x[sb.banned] = float("-inf")
    if sb.bitmask is not None:
        import xgrammar as xgr

        width = min(x.shape[1], sb.bitmask.shape[1] * 32)
        if x.is_cuda or sb.bitmask_rows.numel() == x.shape[0]:
            xgr.apply_token_bitmask_inplace(x, sb.bitmask.to(x.device), indices=sb.bitmask_rows.tolist(), vocab_size=width)
        else:
            sub = x[sb.bitmask_rows]
            xgr.apply_token_bitmask_inplace(sub, sb.bitmask, vocab_size=width)
            x[sb.bitmask_rows] = sub
    return x


def _top_logprobs(x: torch.Tensor, sb: SamplingBatch, ids: torch.Tensor) -> tuple[list, list]:
    rows = (sb.logprobs >= 0).nonzero().flatten()
    logprobs: list[float | None] = [None] * x.shape[0]
    tops: list[list[tuple[int, float]] | None] = [None] * x.shape[0]
    if rows.numel() == 0:
        return logprobs, tops
    lp = torch.log_softmax(x[rows], dim=-1)
    chosen = lp.gather(1, ids[rows, None]).squeeze(1).cpu().tolist()
    k = int(sb.logprobs[rows].max())
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.cpu().tolist(), top_i.cpu().tolist()
    for j, r in enumerate(rows.cpu().tolist()):
        logprobs[r] = chosen[j]
        n = int(sb.logprobs[r])
        tops[r] = list(zip(top_i[j][:n], top_v[j][:n]))
    return logprobs, tops


def _draw_full(p: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Token ids [R] drawn from probabilities p [R, V] (normalized before any min-p zeroing) restricted to
    each row's top-p set, by inverse CDF and rejection (see the module docstring); p is modified."""
    out = torch.empty(p.shape[0], dtype=torch.long, device=p.device)
    todo = torch.arange(p.shape[0], device=p.device)
    for round_ in range(64):
        c = p.cumsum(dim=1)
        total = c[:, -1]
        target = (uniforms(seed[todo], counter[todo], round_) * total.double()).to(c.dtype)
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))  # u < 1 after rounding too
        s = torch.searchsorted(c, target[:, None], right=True).clamp_(max=p.shape[1] - 1)
        ps = p.gather(1, s)
        s = s.squeeze(1)
        check = top_p[todo] < 1
        accept = ~check
        if bool(check.any()):  # the tokens more likely than the draw hold less than top_p: it is in the set
            accept |= torch.where(p > ps, p, 0).sum(dim=1) < top_p[todo].to(p.dtype)
        out[todo[accept]] = s[accept]
        if bool(accept.all()):
            return out
        rej = (~accept).nonzero().flatten()
        p = p[rej]
        p = torch.where(p > ps[rej], p, 0)  # no more likely than a token outside the set: outside too
        todo = todo[rej]
    out[todo] = p.argmax(dim=1)  # only after 64 rejections (float ties): the most likely remaining token
    return out


def _draw(x: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """Draws for the sampled rows `rows` of the processed logits x [R, V]: kept = top-k, the top-p set of the
    top-k distribution, and min-p (probability >= min_p x the most likely one's), renormalized."""
    t = sb.temperature[rows].to(x.dtype)
    xs = x.index_select(0, rows) if rows.numel() != x.shape[0] else x
    if bool((t != 1).any()):
        xs = xs / t[:, None]
    top_k, min_p, top_p = sb.top_k[rows], sb.min_p[rows], sb.top_p[rows].to(x.dtype)
    seed, counter = sb.seed[rows], sb.counter[rows]
    k_cand = min(CANDIDATES, xs.shape[1])
    has_k = top_k > 0
    if bool(has_k.any()):
        kmax = int(top_k.max())
        kth = xs.topk(kmax, dim=1).values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        xs = xs.masked_fill((xs < kth) & has_k[:, None], float("-inf"))
    p = torch.softmax(xs, dim=1)  # the top-k distribution (one fused pass per row)
    cand_p, cand_i = p.topk(k_cand, dim=1)  # a partial sort: the row's k_cand most likely, descending
    floor = min_p[:, None].to(x.dtype) * cand_p[:, :1]
    mass_before = cand_p.cumsum(dim=1) - cand_p
    # exact on the candidates alone when the kept set lies within them
    covered = (has_k & (top_k <= k_cand)) | (cand_p[:, -1:] < floor).squeeze(1)
    covered |= (top_p < 1) & (cand_p.sum(dim=1) >= top_p)
    out = torch.empty(xs.shape[0], dtype=torch.long, device=x.device)
    # which path a row takes depends on its own logits and parameters only: its draw is the same in any batch
    full = (~covered).nonzero().flatten()
    small = covered.nonzero().flatten()
    if small.numel():
        w = cand_p[small]
        w = w * ((mass_before[small] < top_p[small, None]) & (w >= floor[small]))
        pick = _draw_full(w, torch.ones_like(top_p[small]), seed[small], counter[small])
        out[small] = cand_i[small].gather(1, pick[:, None]).squeeze(1)
    if full.numel():
        p = p.index_select(0, full) if full.numel() != p.shape[0] else p
        if bool((min_p > 0).any()):
            p = p.masked_fill(p < floor[full], 0)
        out[full] = _draw_full(p, top_p[full], seed[full], counter[full])
    return out


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampledTokens:
    """Choose the tokens of `sb.rows` from a step's logits [N, V] (any float dtype, any device)."""
    if sb.rows.device != logits.device:
        sb = sb.to(logits.device)
    x = logits.index_select(0, sb.rows).float() if sb.rows.numel() != logits.shape[0] else logits.float()
    errors: dict[int, str] = {}
    x = process_logits(x, sb, errors)
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    greedy = sb.temperature == 0
    g = greedy.nonzero().flatten()
    if g.numel():
        ids[g] = x[g].argmax(dim=1) if g.numel() != x.shape[0] else x.argmax(dim=1)
    s = (~greedy).nonzero().flatten()
    if s.numel():
        ids[s] = _draw(x, sb, s)
    forced = sb.forced >= 0
    if bool(forced.any()):
        ids = torch.where(forced, sb.forced, ids)
    allowed = torch.isfinite(x.gather(1, ids[:, None]).squeeze(1)) | forced
    if not bool(allowed.all()):
        for r in (~allowed).nonzero().flatten().cpu().tolist():
            errors.setdefault(r, "every token was masked (logits processors, grammar, bans): nothing can be sampled")
    logprobs, tops = _top_logprobs(x, sb, ids)
    return SampledTokens(ids.cpu().numpy(), logprobs, tops, errors)

"""Batched sampling inside the runner: one vectorized torch pass over the step's logits [N, V], on the device
the logits were computed on (CPU for ONNX Runtime and the reference model, the GPU for TensorRT); only token
ids (and the logprobs asked for) leave it.

Per row, in this order: the vocabulary limit (ids past the tokenizer), request logits processors (Python
callables; the row alone goes to the host on a GPU), repetition / presence / frequency penalties, logit bias,
banned ids (eos before min_tokens), the grammar bitmask (xgrammar's layout: int32 words, bit j of word i
allows token 32 i + j), then the chosen token's logprob and top logprobs from the log-softmax of these
processed logits (before temperature); then temperature 0 -> argmax, else temperature -> top-k -> min-p ->
top-p and a draw. A forced token (thinking budget) replaces the draw.

Top-k (CPU: a mask), top-p and min-p sort nothing (FlashInfer's rejection sampling with pivots): the kept set
is an upper set of the weights exp((x - max) / temperature), so a draw from the row (or from the tokens above a
pivot) is kept when it lies in the set (top-p: the weight strictly above it is below top_p of the row's total;
min-p: its weight >= min_p, the most likely token's being 1), and when all of a pass's draws are rejected,
every token no more likely than the most likely of them is outside the set too: it becomes the pivot. A pass
makes `PROPOSALS` independent draws, each in one streaming pass over the row (`_proposals`: block by block,
no [R, V] prefix sum), and a top-p row checks them in the next pass, which draws the next proposals with the
same loads: so top-p takes two passes over the logits unless all 8 first proposals are rejected (probability
(1 - kept mass)^8 <= (1 - top_p)^8). The accepted draw follows the renormalized kept distribution exactly.
On CUDA the same draws run as one Triton kernel per step (`sampler_kernels.sample_rows`: one program per row,
the row max found in its first pass, top-k by the same rejection), and greedy rows take one fused argmax pass
(`sampler_kernels.argmax_rows`). There `sample` never waits for the device: which
rows are greedy, forced, sampled, top-k masked or asking for logprobs is read from the host batch, a row with
nothing left to sample is flagged by the kernel (-1) rather than found by a read-back, and the ids, those
flags and the logprobs are copied to the host without waiting; `SampledTokens` waits for that copy when first
read (a request's logits processor is the exception: its row goes to the host). Guards: a top_k at or above
the vocabulary filters nothing; a top_p of 0 (1e-300 in fp32) keeps the most likely token.

Randomness is counter-based: a row's uniform numbers are a hash (splitmix64) of (its request's seed, the
index of the token in its output, the pass, the proposal, the block), so a request draws the same tokens
alone or in any batch, and the CPU and the kernel the same ones (but for float rounding; top-k only rows
differ: the CPU masks, the kernel counts); the core gives unseeded requests a random seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass

import numpy as np
import torch

from moe_export.runtime.engine.sampler_streams import _GOLDEN, _MIX1, _MIX2, BLOCK, PROPOSALS, ROUNDS, STREAM_BLOCKS
from moe_export.runtime.sampling import ROW_COLUMNS


@dataclass(kw_only=True)
class SequenceColumns:
    """The part of a step's `SamplingBatch` that the core adds to the requests' `per_row` values, as host tensors
    (R rows sampled of the step's N).

    rows [R]: the step's sequences that get a token (their last chunk reached the end of their tokens), in
    order. Per row: seed, counter (the token's index in its output), forced (-1: sample), logprobs (-1: none,
    else how many top logprobs, 0..20). Penalty inputs: the (row, token, count) triples of the rows' output
    tokens (presence / frequency) and the (row, token) pairs of their prompt and output tokens (repetition:
    `seen`). logit_bias and banned: (row, token[, value]). bitmask [G, W] int32 for rows `bitmask_rows` [G].
    processors: (row, fn(logits [V] fp32) -> logits). vocab: ids at or past it are never chosen."""

    rows: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    forced: torch.Tensor
    logprobs: torch.Tensor
    vocab: int | None = None
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
        return type(self)(**moved)


SamplingBatch = make_dataclass(
    "SamplingBatch",
    [(name, torch.Tensor) if off is None else (name, torch.Tensor | None, field(default=None))
     for name, (_, off) in ROW_COLUMNS.items()],
    bases=(SequenceColumns,), kw_only=True,
    namespace={"__module__": __name__, "__doc__": """What the runner needs to choose the step's tokens: the
    `SequenceColumns` and one column [R] per `per_row` field of `SamplingParams`, under its name (`ROW_COLUMNS`):
    temperature, top_k (0: off), top_p, min_p; repetition_penalty, presence_penalty and frequency_penalty (None
    when no row of the step uses them)."""},
)


class SampledTokens:
    """The chosen ids [R] (host); for rows that asked, their logprob and top logprobs; errors: rows that got
    no token (a logits processor failed, or every token was masked) -> why. Made by `sample` from device
    results whose copy to the host is under way (`pending`): the first read of a field waits for that copy."""

    def __init__(self, ids: np.ndarray, logprobs: list[float | None], top_logprobs: list[list[tuple[int, float]] | None],
                 errors: dict[int, str] | None = None) -> None:  # fmt: skip
        self._fields = (ids, logprobs, top_logprobs, {} if errors is None else errors)
        self._finish: Callable[[], tuple] | None = None

    @classmethod
    def pending(cls, finish: Callable[[], tuple]) -> SampledTokens:
        """Fields made by `finish()` -> (ids, logprobs, top_logprobs, errors) at the first read."""
        out = cls.__new__(cls)
        out._fields, out._finish = None, finish
        return out

    def _get(self) -> tuple:
        if self._fields is None:
            self._fields, self._finish = self._finish(), None
        return self._fields

    @property
    def copy_pending(self) -> bool:
        """Whether the fields still wait for their copy from the device (`sample`'s result before its first read)."""
        return self._fields is None

    def wait(self) -> None:
        """Wait for the copy now (what the first read of a field would do)."""
        self._get()

    @property
    def ids(self) -> np.ndarray:
        return self._get()[0]

    @property
    def logprobs(self) -> list[float | None]:
        return self._get()[1]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None]:
        return self._get()[2]

    @property
    def errors(self) -> dict[int, str]:
        return self._get()[3]


def draw_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[R] int64: the key of each row's uniforms, a hash input of (its request's seed, the token's index)."""
    return seed * _GOLDEN + counter * _MIX1


def stream_uniforms(key: torch.Tensor, round_: int, k: torch.Tensor, block: torch.Tensor, which: int) -> torch.Tensor:
    """float64 in [0, 1) (the broadcast shape of key, k and block): splitmix64 of key + s x MIX2, the stream s
    naming the pass `round_`, the proposal k, the block and which of its two uniforms (0: whether the block
    takes the proposal, 1: where in the block); 53 random bits each. `sampler_kernels._uniform` hashes the same."""
    s = ((k + round_ * PROPOSALS) * STREAM_BLOCKS + block) * 2 + (which + 1)
    return _splitmix_uniform(key + s * _MIX2)


def _splitmix_uniform(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def process_logits(x: torch.Tensor, sb: SamplingBatch, errors: dict[int, str], host: SamplingBatch | None = None
                   ) -> torch.Tensor:
    """Everything before temperature, in place on x [R, V] fp32 (sb on x's device; `host`: the same batch on
    the host, default sb, for the grammar rows' list); a failing processor's row goes to `errors`. Nothing is
    read back from the device unless a request brings a logits processor (its row goes to the host)."""
    host = sb if host is None else host
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
    if sb.seen is not None:  # repetition: positive logits divided, negative ones multiplied
        r, t = sb.seen
        vals = x[r, t]
        pen = sb.repetition_penalty[r]
        x[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
    if sb.output_counts is not None:  # frequency per occurrence, presence once (None: no row of the step has it)
        r, t, c = sb.output_counts
        sub = sb.frequency_penalty[r] * c if sb.frequency_penalty is not None else torch.zeros_like(c)
        if sb.presence_penalty is not None:
            sub = sub + sb.presence_penalty[r]
        x.index_put_((r, t), -sub, accumulate=True)
    if sb.logit_bias is not None:
        r, t, v = sb.logit_bias
        x.index_put_((r, t), v, accumulate=True)
    if sb.banned is not None:
        x[sb.banned] = float("-inf")
    if sb.bitmask is not None:
        import xgrammar as xgr

        width = min(x.shape[1], sb.bitmask.shape[1] * 32)
        if x.is_cuda or sb.bitmask_rows.numel() == x.shape[0]:
            xgr.apply_token_bitmask_inplace(x, sb.bitmask, indices=host.bitmask_rows.tolist(), vocab_size=width)
        else:
            sub = x[sb.bitmask_rows]
            xgr.apply_token_bitmask_inplace(sub, sb.bitmask, vocab_size=width)
            x[sb.bitmask_rows] = sub
    return x


def _log_softmax_rows(x: torch.Tensor, host: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows asking for logprobs (host), their log-softmax [n, V]) of the processed logits; None when no row
    asks (decided on the host batch)."""
    rows = (host.logprobs >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    return rows, torch.log_softmax(x.index_select(0, rows.to(x.device, non_blocking=True)), dim=-1)


def _logprob_tensors(lp: tuple[torch.Tensor, torch.Tensor] | None, host: SamplingBatch, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(chosen token's logprob [n], top values [n, k], top ids [n, k]) on the device for the rows asking
    (k: the most any asks, read from the host batch)."""
    if lp is None:
        return None
    rows, lp = lp
    chosen = lp.gather(1, ids.index_select(0, rows.to(ids.device, non_blocking=True))[:, None]).squeeze(1)
    k = int(host.logprobs[rows].max())
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return chosen, top_v, top_i


def _logprob_lists(rows: torch.Tensor | None, host: SamplingBatch, n: int, chosen, top_v, top_i) -> tuple[list, list]:
    """The per-row logprob and top-logprob lists from host copies of `_logprob_tensors`."""
    logprobs: list[float | None] = [None] * n
    tops: list[list[tuple[int, float]] | None] = [None] * n
    if rows is None:
        return logprobs, tops
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for j, r in enumerate(rows.tolist()):
        logprobs[r] = chosen[j]
        k = int(host.logprobs[r])
        tops[r] = list(zip(top_i[j][:k], top_v[j][:k]))
    return logprobs, tops


def _proposals(w: torch.Tensor, key: torch.Tensor, round_: int) -> torch.Tensor:
    """[n, PROPOSALS] token ids, each drawn independently from the weights w [n, V] (>= 0, each row with a
    positive sum) as the kernel draws in one streaming pass: block b (BLOCK tokens) takes proposal k when
    u(k, b) x (the weight of blocks 0..b) < (block b's weight), the last block taking it keeps it (so block b
    holds it with probability its share of the row), and the token is the first of that block whose running
    sum exceeds v(k, b) x the block's weight (u, v: `stream_uniforms` of the pass `round_`)."""
    n, width = w.shape
    nb = -(-width // BLOCK)
    blocks = w if width % BLOCK == 0 or nb == 1 else torch.nn.functional.pad(w, (0, nb * BLOCK - width))
    blocks = blocks.view(n, nb, -1)
    sums = blocks.sum(2).double()
    k = torch.arange(PROPOSALS)[None, :, None]
    u = stream_uniforms(key[:, None, None], round_, k, torch.arange(nb)[None, None, :], 0)
    takes = u * sums.cumsum(1)[:, None, :] < sums[:, None, :]
    b = torch.where(takes, torch.arange(nb), -1).amax(2).clamp_(min=0)  # [n, K]
    target = stream_uniforms(key[:, None], round_, k[..., 0], b, 1) * sums.gather(1, b)
    running = blocks[torch.arange(n)[:, None], b].cumsum(2)  # [n, K, block] fp32: the chosen blocks
    below = target.float()  # the largest fp32 <= target: running <= it exactly where running <= target
    below = torch.where(below.double() > target, torch.nextafter(below, torch.tensor(-math.inf)), below)
    j = torch.searchsorted(running, below[..., None], right=True)[..., 0]
    last = torch.searchsorted(running, running[..., -1:].contiguous())[..., 0]  # rounding: the
    return b * BLOCK + torch.minimum(j, last)  # block's last kept token


def _mass_above(p: torch.Tensor, ps: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n]: the sum of the weights strictly above ps [n] in each of p's rows `rows` [n] (default: all): a scalar
    threshold per row through one reused row buffer (at [64, 163840] on 2 quiet cores: 2.8 ms, against 7 ms single-threaded in NumPy and
    ~60 ms for one [R, 1]-broadcast `torch.where`; under CPU contention each row's parallel op may wait for the
    second core)."""
    buf = torch.empty(p.shape[1], dtype=p.dtype, device=p.device)
    rows = range(p.shape[0]) if rows is None else rows.tolist()
    out = torch.empty(len(rows), dtype=p.dtype, device=p.device)
    for i, (r, v) in enumerate(zip(rows, ps.tolist())):
        torch.nn.functional.threshold_(buf.copy_(p[r]), v, 0.0)
        out[i] = buf.sum()
    return out


def _draw_rejection(p: torch.Tensor, z: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, key: torch.Tensor
                    ) -> torch.Tensor:
    """Token ids [R] drawn from the weights p [R, V] (the most likely token's 1) restricted to each row's top-p
    set (of the distribution whose sum is z [R]) and min-p set (weight >= min_p), sorting nothing, the same
    draws as the kernel (`sampler_kernels`, which see): per pass `PROPOSALS` proposals from the tokens above
    the pivot (pass 0: all; later: min-p's too); a top-p row checks a pass's proposals in the next pass (the
    weight strictly above each < top_p x z, and min-p), others at once (min-p); the first kept proposal is the
    draw; when none is, the most likely of them becomes the pivot (for top-p rows, from the pass after next)."""
    n = p.shape[0]
    out = torch.empty(n, dtype=torch.long)
    todo = torch.arange(n)
    low = torch.full((n,), -1.0, dtype=p.dtype)
    check = top_p < 1
    prev_i = prev_p = None
    for round_ in range(ROUNDS):
        q = p.index_select(0, todo) if todo.numel() != n else p
        floor = min_p[todo, None] if round_ else 0.0
        w = torch.where((q > low[:, None]) & (q >= floor), q, 0) if round_ else q  # pass 0: the whole row
        cand_i = _proposals(w, key[todo], round_)
        cand_p = q.gather(1, cand_i)
        chk = check[todo]
        if prev_i is None:
            prev_i, prev_p = cand_i, torch.full_like(cand_p, 2.0)
        seen_i = torch.where(chk[:, None], prev_i, cand_i)
        seen_p = torch.where(chk[:, None], prev_p, cand_p)
        kept = seen_p >= min_p[todo, None]
        if round_ == 0:
            kept &= ~chk[:, None]
        pick = torch.full((todo.numel(),), PROPOSALS)
        for k in range(PROPOSALS):  # the top-p sums only for rows whose earlier proposals were all rejected
            ask = chk & (pick == PROPOSALS) & kept[:, k]
            if bool(ask.any()):
                a = ask.nonzero().flatten()
                pz = (top_p[todo] * z[todo])[a]
                kept[a, k] = _mass_above(q, seen_p[a, k], a).double() < pz
            pick = torch.where((pick == PROPOSALS) & kept[:, k], k, pick)
        found = pick < PROPOSALS
        out[todo[found]] = seen_i[found].gather(1, pick[found, None]).squeeze(1)
        low = torch.maximum(low, seen_p.masked_fill(seen_p > 1, -1.0).amax(1))
        rest = ~found
        todo, low, prev_i, prev_p = todo[rest], low[rest], cand_i[rest], cand_p[rest]
        if todo.numel() == 0:
            return out
    out[todo] = p.index_select(0, todo).argmax(dim=1)  # after ROUNDS passes (float ties): the most likely token
    return out


def _draw(x: torch.Tensor, sb: SamplingBatch, host: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """Draws [n] for the sampled rows `rows` [n] (host) of the processed logits x [R, V] (sb on x's device, host
    the same batch on the host), in place on those rows of x: kept = top-k, the top-p set of the top-k
    distribution, and min-p (probability >= min_p x the most likely one's), renormalized; -1 for a row whose
    logits are all -inf. On CUDA (`_use_kernels`) the Triton kernel, with nothing read back; on the CPU torch."""
    if _use_kernels(x):
        return _draw_kernel(x, sb, host, rows)
    out = torch.full((rows.numel(),), -1, dtype=torch.long)
    row_max = x.amax(dim=1).index_select(0, rows)
    finite = torch.isfinite(row_max)
    rows, row_max = rows[finite], row_max[finite]
    if rows.numel() == 0:
        return out
    t = sb.temperature[rows].to(x.dtype)
    xs = x.index_select(0, rows) if rows.numel() != x.shape[0] else x
    top_k, top_p = _guarded_top_k_p(sb.top_k[rows], sb.top_p[rows].to(torch.float64))
    min_p = sb.min_p[rows]
    _mask_top_k(xs, top_k, top_k > 0, top_k)
    xs.sub_(row_max[:, None])
    if bool((t != 1).any()):
        xs.div_(t[:, None])
    p = xs.exp_()  # the top-k distribution's weights, the most likely token's 1
    z = p.sum(dim=1).double()
    out[finite] = _draw_rejection(p, z, top_p, min_p.to(p.dtype), draw_keys(sb.seed[rows], sb.counter[rows]))
    return out


def _guarded_top_k_p(top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k, top_p) [R] as the draws take them: a top_p of 0 (below the smallest mass its dtype represents,
    e.g. 1e-300 in fp32) keeps the most likely token alone (top_k 1, top_p 1); a top_k at or above the
    vocabulary filters nothing (`_mask_top_k`, the kernel's count)."""
    none = top_p <= 0
    return torch.where(none, 1, top_k), torch.where(none, 1.0, top_p)


def _mask_top_k(xs: torch.Tensor, top_k: torch.Tensor, on: torch.Tensor, host_top_k: torch.Tensor) -> None:
    """Logits below the top_k-th largest of each row where `on` [R] (bool, host) become -inf, in place on xs
    [R, V] (top_k [R] on xs's device, host_top_k the same on the host: the largest k is read there); a top_k at
    or above V keeps the row (no top-k filter)."""
    on = on & (host_top_k < xs.shape[1])
    if bool(on.any()):
        k = int(host_top_k[on].max())
        kth = xs.topk(k, dim=1).values.gather(1, (top_k.clamp(1, k) - 1)[:, None])  # rows not `on`: any column
        xs.masked_fill_((xs < kth) & on.to(xs.device, non_blocking=True)[:, None], float("-inf"))


def _draw_kernel(x: torch.Tensor, sb: SamplingBatch, host: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """`_draw` by `sampler_kernels.sample_rows` (rows [n] host): top-k, min-p and top-p by rejection, sorting
    nothing; only rows with both top-k and top-p < 1 get their top-k mask first (their top-p set is taken of
    the top-k mass). The decisions are read from the host batch: nothing waits for the device."""
    from moe_export.runtime.engine.sampler_kernels import sample_rows

    on_device = rows.to(x.device, non_blocking=True)
    xs = x.index_select(0, on_device) if rows.numel() != x.shape[0] else x
    top_k, top_p = _guarded_top_k_p(sb.top_k[on_device], sb.top_p[on_device])
    host_k, host_p = _guarded_top_k_p(host.top_k[rows], host.top_p[rows])
    _mask_top_k(xs, top_k, (host_k > 0) & (host_p < 1), host_k)
    keys = draw_keys(sb.seed[on_device], sb.counter[on_device])
    return sample_rows(xs, sb.temperature[on_device], top_k, top_p, sb.min_p[on_device], keys)


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether the draws take the Triton kernels (CUDA logits) or torch on the CPU."""
    return x.is_cuda


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """[R] each row's argmax of x [R, V] (lowest index on ties): one Triton pass with the kernels."""
    if _use_kernels(x):
        from moe_export.runtime.engine.sampler_kernels import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=1)


_MASKED = "every token was masked (logits processors, grammar, bans): nothing can be sampled"


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampledTokens:
    """Choose the tokens of `sb.rows` (a batch of host tensors) from a step's logits [N, V] (any float dtype,
    any device); fp32 logits of every row are used in place. Every decision that depends on the requests is
    read from the host batch and nothing is read back from the device (unless a request brings a logits
    processor): the ids, the rows with nothing to sample and the asked-for logprobs are copied to the host
    without waiting, and the returned `SampledTokens` waits for that copy when first read."""
    host = sb
    sb = sb.to(logits.device)
    x = logits.index_select(0, sb.rows).float() if host.rows.numel() != logits.shape[0] else logits.float()
    errors: dict[int, str] = {}
    x = process_logits(x, sb, errors, host)
    lp = _log_softmax_rows(x, host)  # before the draws change x
    n = x.shape[0]
    ids = torch.zeros(n, dtype=torch.long, device=x.device)
    greedy, forced = host.temperature == 0, host.forced >= 0
    allowed = sb.forced >= 0
    if bool(greedy.any()):
        g = greedy.nonzero().flatten()
        on_device = g.to(x.device, non_blocking=True)
        ids[on_device] = _argmax(x.index_select(0, on_device) if g.numel() != n else x)
        allowed[on_device] |= torch.isfinite(x.gather(1, ids[on_device, None]).squeeze(1))
    sampled = ~greedy & ~forced
    if bool(sampled.any()):
        s = sampled.nonzero().flatten()
        on_device = s.to(x.device, non_blocking=True)
        drawn = _draw(x, sb, host, s)
        allowed[on_device] |= drawn >= 0
        ids[on_device] = drawn.clamp(min=0)
    if bool(forced.any()):
        ids = torch.where(sb.forced >= 0, sb.forced, ids)
    logprob_rows = None if lp is None else lp[0]
    results = [ids, allowed, *(_logprob_tensors(lp, host, ids) or ())]
    copies = [t.to("cpu", non_blocking=True) for t in results]
    done = None
    if x.is_cuda:
        done = torch.cuda.Event()
        done.record()

    def finish() -> tuple:
        if done is not None:
            done.synchronize()
        ids_h, allowed_h, *lps = copies
        for r in (~allowed_h).nonzero().flatten().tolist():
            errors.setdefault(r, _MASKED)
        logprobs, tops = _logprob_lists(logprob_rows, host, n, *(lps or (None, None, None)))
        return ids_h.numpy(), logprobs, tops, errors

    return SampledTokens.pending(finish)

"""Triton kernels of the sampler's GPU path (`sampler.sample` on CUDA tensors), one program per row streaming
the row's logits [V] from memory; nothing of size [R, V] is written.

`argmax_rows`: greedy, the largest logit of each row in one pass (lowest index on ties, as torch.argmax).

`sample_rows`: temperature, top-k, min-p and top-p without sorting, by rejection (FlashInfer's rejection
sampling with pivots, its proposals drawn in the same pass that checks the previous ones). A token's weight is
exp((x - row max) / temperature), recomputed from the logits at each pass, the block's loads shared by
everything the pass does. Each pass draws `PROPOSALS` tokens, independently, from the tokens above the row's
pivot, in one streaming pass (per block of `sampler.BLOCK` tokens: the block replaces proposal k's when
u(k, b) x (the weight so far) < (the block's weight), the token then taken by inverse CDF inside the block at
v(k, b); the uniforms are `sampler.stream_uniforms`, hashed here). Pass 0 also finds the row max (the weights
so far rescaled as it grows) and the sum z that top-p is taken of; pass r >= 1 counts and sums, for each of
the previous pass's proposals, the tokens strictly more likely than it: a proposal is kept when fewer than
top_k tokens and less than top_p x z of weight lie above it and its weight is >= min_p; the first kept one (in
proposal order) is the draw. When all are rejected, every token no more likely than the most likely of them is
outside the kept set too: it becomes the pivot (for the proposals of the pass after next). Rows without top-p
or top-k check their proposals at once (min-p only). Every accepted draw follows the renormalized kept
distribution exactly (each proposal is drawn from a superset of the kept set chosen before its uniforms are
read); a top-p row takes 2 passes over its logits unless all `PROPOSALS` proposals of pass 0 fall outside the
kept set (probability (1 - kept mass)^PROPOSALS <= (1 - top_p)^PROPOSALS). After `ROUNDS` passes (float ties
only) the most likely token is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_export.runtime.engine.sampler_streams import _MIX1, _MIX2, BLOCK, PROPOSALS, ROUNDS, STREAM_BLOCKS

ARGMAX_BLOCK = 4096  # tokens per program step of the argmax
ARGMAX_WARPS = 16
WARPS = 16  # the draw: BLOCK tokens per step, 2 per thread

MIX1 = tl.constexpr(_MIX1)
MIX2 = tl.constexpr(_MIX2)
STREAMS = tl.constexpr(STREAM_BLOCKS)


@triton.jit
def _argmax_kernel(x_ptr, stride, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = offs
    for start in range(0, V, BLOCK):
        idx = start + offs
        v = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        take = v > best  # strict: each lane keeps its first (lowest) index of its maximum
        best = tl.where(take, v, best)
        best_i = tl.where(take, idx, best_i)
    m = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == m, best_i, V), 0).to(tl.int64))


@triton.jit
def _uniform(key, r, k, b, which, K: tl.constexpr):
    """[K] float64 in [0, 1) for the proposals k [K]: `sampler.stream_uniforms(key, r, k, b, which)` (splitmix64
    in int64 arithmetic)."""
    s = ((key * 0 + r * K + k) * STREAMS + b) * 2 + which + 1
    x = key + s * MIX2
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & ((1 << 53) - 1)).to(tl.float64) * (1.0 / (1 << 53))


@triton.jit
def _sample_kernel(x_ptr, stride, t_ptr, k_ptr, p_ptr, min_p_ptr, key_ptr, out_ptr, V,
                   ROUNDS: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    t = tl.load(t_ptr + row)
    top_k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row).to(tl.float64)
    min_p = tl.load(min_p_ptr + row)
    key = tl.load(key_ptr + row)
    check = (top_p < 1) | (top_k > 0)  # proposals checked by counting and summing in the next pass
    offs = tl.arange(0, BLOCK)
    ks = tl.arange(0, K)
    m = tl.full([], float("-inf"), tl.float32)  # the row max (pass 0: so far)
    first = V  # the lowest index of the row max
    z = tl.full([], 0.0, tl.float64)
    low = tl.full([], -1.0, tl.float32)  # the pivot: tokens at or below it are outside the kept set
    prev_i = tl.full([K], -1, tl.int32)  # the previous pass's proposals (check rows), their weights
    prev_p = tl.full([K], 2.0, tl.float32)
    out = -1
    done = 0
    for r in range(ROUNDS):
        if done == 0:
            floor = tl.where(r == 0, 0.0, min_p)  # pass 0 knows no max yet: min-p is checked after it
            total = z * 0
            cand_i = tl.full([K], -1, tl.int32)
            cand_x = tl.full([K], 0.0, tl.float32)
            mass = tl.zeros([K, BLOCK], tl.float32)
            count = tl.zeros([K, BLOCK], tl.int32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                bm = tl.max(x, 0)
                if bm > m:
                    first = tl.min(tl.where(x == bm, idx, V), 0)
                m_new = tl.maximum(m, bm)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: every weight 0
                total = total * tl.exp((m - m_safe) / t).to(tl.float64)  # 0 while m is -inf
                m = m_new
                p = tl.exp((x - m_safe) / t)
                w = tl.where((p > low) & (p >= floor), p, 0.0)
                wb = tl.sum(w, 0).to(tl.float64)
                total += wb
                takes = _uniform(key, r, ks, start // BLOCK, 0, K) * total < wb  # [K]: the block takes proposal k
                if tl.max(takes.to(tl.int32), 0) > 0:
                    target = _uniform(key, r, ks, start // BLOCK, 1, K) * wb
                    j = tl.sum((tl.cumsum(w, 0).to(tl.float64)[None, :] <= target[:, None]).to(tl.int32), 1)
                    j = tl.minimum(j, tl.max(tl.where(w > 0, offs, -1), 0))  # rounding: the last kept token
                    cand_i = tl.where(takes, start + j, cand_i)
                    cand_x = tl.where(takes, tl.sum(tl.where(offs[None, :] == j[:, None], x[None, :], 0.0), 1), cand_x)
                above = p[None, :] > prev_p[:, None]
                mass += tl.where(above, p[None, :], 0.0)
                count += above.to(tl.int32)
            if r == 0:
                z = total
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            cand_p = tl.where(cand_i >= 0, tl.exp((cand_x - m_safe) / t), 2.0)
            if check:
                mass_bound = tl.where(top_p >= 1, float("inf"), top_p * z)  # no top-p: any mass
                count_bound = tl.where(top_k <= 0, V + 1, top_k)  # no top-k: any count
                kept = (prev_i >= 0) & (prev_p >= min_p) & (tl.sum(mass.to(tl.float64), 1) < mass_bound)
                kept = kept & (tl.sum(count, 1) < count_bound)
                seen_i = prev_i
                seen_p = prev_p
            else:
                kept = (cand_i >= 0) & (cand_p >= min_p)
                seen_i = cand_i
                seen_p = cand_p
            pick = tl.min(tl.where(kept, ks, K), 0)
            if m == float("-inf"):  # every logit masked: nothing to draw
                done = 1
            elif pick < K:
                out = tl.sum(tl.where(ks == pick, seen_i, 0), 0)
                done = 1
            else:
                low = tl.maximum(low, tl.max(tl.where(seen_i >= 0, seen_p, -1.0), 0))
            prev_i = cand_i
            prev_p = cand_p
    if done == 0:  # ROUNDS passes rejected (float ties only): the most likely token
        out = first
    tl.store(out_ptr + row, out.to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = ARGMAX_BLOCK) -> torch.Tensor:
    """[R] int64: each row's argmax of x [R, V] (rows contiguous), lowest index on ties, NaN-free logits."""
    assert x.dim() == 2 and x.stride(1) == 1, "argmax_rows takes [R, V] logits with contiguous rows"
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if x.shape[0]:
        block = min(block, triton.next_power_of_2(x.shape[1]))
        _argmax_kernel[(x.shape[0],)](x, x.stride(0), out, x.shape[1], BLOCK=block, num_warps=ARGMAX_WARPS)
    return out


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R] int64 token ids drawn from logits x [R, V] (fp32, rows contiguous; -inf: never drawn; -1 for a row
    whose logits are all -inf), per row: temperature (> 0), top_k (int64, 0: off; at or above V: no filter),
    top_p, min_p (fp32) and keys (int64, `sampler.draw_keys` of its seed and counter). top_p applies to the
    distribution after top-k only when the row holds no more than its top-k tokens (the caller masks the rest
    when both are set)."""
    assert x.dim() == 2 and x.stride(1) == 1, "sample_rows takes [R, V] logits with contiguous rows"
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if x.shape[0]:
        _sample_kernel[(x.shape[0],)](
            x, x.stride(0), temperature.float().contiguous(), top_k.long().contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous(), keys.long().contiguous(), out, x.shape[1], ROUNDS=ROUNDS, K=PROPOSALS,
            BLOCK=min(BLOCK, triton.next_power_of_2(x.shape[1])), num_warps=WARPS,  # one block either way
        )  # fmt: skip
    return out

"""Triton kernels of the sampler's GPU path (`sampler.sample` on CUDA tensors), one program per row streaming
the row's logits [V] from memory; nothing of size [R, V] is written.

`argmax_rows`: greedy, the largest logit of each row in one pass (lowest index on ties, as torch.argmax).

`sample_rows`: temperature, top-k, min-p and top-p without sorting (FlashInfer's rejection sampling with
pivots). A token's weight is exp((x - row max) / temperature), recomputed from the logits at each pass. Pass 0
sums the weights (z, the sum the top-p set is taken of) and those min-p keeps. Each round draws one token by
inverse CDF from the tokens above the row's pivot (the first token whose running sum exceeds u x their sum,
u from the round's uniform; the scan stops at that token's block), then one pass counts the tokens and sums
the weight strictly above the draw: the draw is accepted when fewer than top_k tokens and less than
top_p x z of weight lie above it; else every token no more likely is outside the kept set as well, the draw's
weight becomes the pivot and the next round draws from what is above it (the sum just computed). Accepted
draws follow the renormalized kept distribution exactly. After `ROUNDS` rejections (float ties only) the most
likely token is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUNDS = 32  # draws per row at most; the uniforms table is [R, ROUNDS]
BLOCK = 4096  # tokens per program step
WARPS = 16


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
def _weights(base, idx, V, m, t):
    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    return tl.exp((x - m) / t)


@triton.jit
def _sample_kernel(x_ptr, stride, max_ptr, t_ptr, k_ptr, p_ptr, min_p_ptr, u_ptr, out_ptr, V,
                   ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    m = tl.load(max_ptr + row)
    no_token = m == float("-inf")  # every logit masked: no weight is computed from it (-inf - -inf is NaN)
    m = tl.where(no_token, 0.0, m)
    t = tl.load(t_ptr + row)
    top_k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row).to(tl.float64)
    min_p = tl.load(min_p_ptr + row)
    offs = tl.arange(0, BLOCK)
    z = tl.sum(tl.zeros([BLOCK], tl.float64), 0)
    total = z
    first = V
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        p = tl.exp((x - m) / t)
        z += tl.sum(p, 0).to(tl.float64)
        total += tl.sum(tl.where(p >= min_p, p, 0.0), 0).to(tl.float64)
        first = tl.minimum(first, tl.min(tl.where(x == m, idx, V), 0))
    check = (top_p < 1) | (top_k > 0)
    low = -1.0  # the pivot: tokens at or below it are outside the kept set
    out = first
    done = 0
    for r in range(ROUNDS):
        if done == 0:
            target = tl.load(u_ptr + row * ROUNDS + r) * total
            acc = total * 0
            s = -1
            p_s = low
            start = 0
            while (s < 0) & (start < V):  # the inverse CDF: stops at the drawn token's block
                idx = start + offs
                p = _weights(base, idx, V, m, t)
                w = tl.where((p > low) & (p >= min_p), p, 0.0)
                bs = tl.sum(w, 0).to(tl.float64)
                if acc + bs > target:
                    j = tl.sum((tl.cumsum(w, 0).to(tl.float64) + acc <= target).to(tl.int32), 0)
                    j = tl.minimum(j, tl.max(tl.where(w > 0, offs, -1), 0))  # rounding: the block's last kept token
                    s = start + j
                    p_s = tl.sum(tl.where(offs == j, w, 0.0), 0)
                acc += bs
                start += BLOCK
            if s < 0:  # rounding past the row's end
                s = first
                p_s = 1.0
            if check:
                mass = total * 0
                count = 0
                for start2 in range(0, V, BLOCK):
                    p = _weights(base, start2 + offs, V, m, t)
                    above = p > p_s
                    mass += tl.sum(tl.where(above, p, 0.0), 0).to(tl.float64)
                    count += tl.sum(above.to(tl.int32), 0)
                if ((top_p >= 1) | (mass < top_p * z)) & ((top_k <= 0) | (count < top_k)):
                    out = s
                    done = 1
                else:
                    low = p_s
                    total = mass
            else:
                out = s
                done = 1
    tl.store(out_ptr + row, tl.where(no_token, -1, out.to(tl.int64)))


def argmax_rows(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[R] int64: each row's argmax of x [R, V] (rows contiguous), lowest index on ties, NaN-free logits."""
    assert x.dim() == 2 and x.stride(1) == 1, "argmax_rows takes [R, V] logits with contiguous rows"
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if x.shape[0]:
        block = min(block, triton.next_power_of_2(x.shape[1]))
        _argmax_kernel[(x.shape[0],)](x, x.stride(0), out, x.shape[1], BLOCK=block, num_warps=WARPS)
    return out


def sample_rows(x: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[R] int64 token ids drawn from logits x [R, V] (fp32, rows contiguous; -inf: never drawn; -1 for a row
    whose logits are all -inf), per row: row_max (its largest logit), temperature (> 0), top_k (int64, 0: off;
    at or above V: no filter), top_p, min_p (fp32) and
    u [R, ROUNDS] float64 (the uniforms of its draw rounds). top_p applies to the distribution after top-k
    only when the row holds no more than its top-k tokens (the caller masks the rest when both are set)."""
    assert x.dim() == 2 and x.stride(1) == 1, "sample_rows takes [R, V] logits with contiguous rows"
    assert u.shape == (x.shape[0], ROUNDS) and u.dtype == torch.float64 and u.is_contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if x.shape[0]:
        block = min(block, triton.next_power_of_2(x.shape[1]))
        _sample_kernel[(x.shape[0],)](
            x, x.stride(0), row_max.float().contiguous(), temperature.float().contiguous(), top_k.long().contiguous(),
            top_p.float().contiguous(), min_p.float().contiguous(), u, out, x.shape[1], ROUNDS=ROUNDS, BLOCK=block,
            num_warps=WARPS,
        )  # fmt: skip
    return out

"""Triton MoEMXFP4 (semantics in `reference.py`): W4A16 grouped GEMM with MXFP4 dequantized in the kernel.

Host side (torch, any device): the (token, choice) pairs routed to this rank are sorted by local expert and
each expert's run is padded to a multiple of BLOCK_M (padding = -1), so every M-block has one expert.
Kernel 1, grid (M-blocks, I/BLOCK_N): gathers the block's token rows of x, and for its expert's gate rows n and
up rows I+n accumulates x @ W^T over the input dim, BLOCK_KP bytes (2*BLOCK_KP elements) per step: each byte
gives an even-column value (low nibble) and an odd-column value (high nibble), so the step is
dot(x_even, lo^T) + dot(x_odd, hi^T); nibble -> E2M1 and byte -> 2^(s-127) are decoded bit-exactly in
registers. The gated activation is applied in the epilogue -> act [P_pad, I] fp32.
Kernel 2, grid (M-blocks, D/BLOCK_N): act @ W2^T the same way, times the routing weight, stored at the
pair's row of a [T*k, D] buffer (zeros for pairs of other ranks); y = buffer.view(T, k, D).sum(1).
Dot products use `input_precision="ieee"` (fp32 accumulate). Runs on CUDA tensors or under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from .cpu import group_by_expert, rank_in_group
from .reference import ACTIVATIONS


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (sign in bit 3) -> fp32 values, exactly."""
    e = (code >> 1) & 3
    m = code & 1
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, ((2 + m) << e).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _e8m0(s):
    """int32 E8M0 bytes -> 2^(s-127) fp32 exactly (0 -> 2^-127 subnormal, 255 -> NaN)."""
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_dot(acc, a_ptrs, a_mask, w_ptrs, s_ptrs, w_mask):
    """acc += a @ W^T for one step: a_ptrs -> even input columns [BM, BKP] (odd = +1), w_ptrs -> bytes
    [BN, BKP], s_ptrs -> the scale byte of each of those bytes."""
    a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
    a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
    byte = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
    scale = _e8m0(tl.load(s_ptrs, mask=w_mask, other=127).to(tl.int32))
    lo = _e2m1(byte & 15) * scale
    hi = _e2m1(byte >> 4) * scale
    acc += tl.dot(a_even, tl.trans(lo), input_precision="ieee")
    acc += tl.dot(a_odd, tl.trans(hi), input_precision="ieee")
    return acc


@triton.jit
def _moe_up_kernel(
    x_ptr, pair_ptr, block_expert_ptr, w_ptr, s_ptr, act_ptr,
    dim, inter, top_k, situ_beta, situ_linear_beta,
    stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_at,
    ACT_SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_KP)
    pair = tl.load(pair_ptr + offs_m)
    valid_m = pair >= 0
    token = tl.where(valid_m, pair // top_k, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    mask_n = offs_n < inter
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, dim // 2, BLOCK_KP):
        kp = kb + offs_kp
        mask_k = kp < dim // 2
        a_ptrs = x_ptr + token[:, None] * stride_xt + 2 * kp[None, :]
        a_mask = valid_m[:, None] & mask_k[None, :]
        w_mask = mask_n[:, None] & mask_k[None, :]
        g_rows = offs_n[:, None]
        u_rows = offs_n[:, None] + inter
        acc_g = _mx_dot(acc_g, a_ptrs, a_mask, w_base + g_rows * stride_wr + kp[None, :],
                        s_base + g_rows * stride_sr + (kp // 16)[None, :], w_mask)
        acc_u = _mx_dot(acc_u, a_ptrs, a_mask, w_base + u_rows * stride_wr + kp[None, :],
                        s_base + u_rows * stride_sr + (kp // 16)[None, :], w_mask)
    sig = 1.0 / (1.0 + tl.exp(-acc_g))
    if ACT_SILU:
        act = acc_g * sig * acc_u
    else:
        tanh_g = 2.0 / (1.0 + tl.exp(-2.0 * acc_g / situ_beta)) - 1.0
        tanh_u = 2.0 / (1.0 + tl.exp(-2.0 * acc_u / situ_linear_beta)) - 1.0
        act = situ_beta * tanh_g * sig * (situ_linear_beta * tanh_u)
    tl.store(act_ptr + offs_m[:, None] * stride_at + offs_n[None, :], act, mask=valid_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr, pair_ptr, block_expert_ptr, route_w_ptr, w_ptr, s_ptr, out_ptr,
    dim, inter,
    stride_at, stride_we, stride_wr, stride_se, stride_sr, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_KP)
    pair = tl.load(pair_ptr + offs_m)
    valid_m = pair >= 0
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    mask_n = offs_n < dim
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, inter // 2, BLOCK_KP):
        kp = kb + offs_kp
        mask_k = kp < inter // 2
        acc = _mx_dot(
            acc,
            act_ptr + offs_m[:, None] * stride_at + 2 * kp[None, :],
            valid_m[:, None] & mask_k[None, :],
            w_base + offs_n[:, None] * stride_wr + kp[None, :],
            s_base + offs_n[:, None] * stride_sr + (kp // 16)[None, :],
            mask_n[:, None] & mask_k[None, :],
        )
    route_w = tl.load(route_w_ptr + tl.where(valid_m, pair, 0), mask=valid_m, other=0.0)
    acc = acc * route_w[:, None]
    out_rows = tl.where(valid_m, pair, 0)
    tl.store(out_ptr + out_rows[:, None] * stride_ot + offs_n[None, :], acc, mask=valid_m[:, None] & mask_n[None, :])


def padded_expert_blocks(expert_ids: torch.Tensor, expert_offset: int, num_local: int, block_m: int):
    """Pair layout for the kernels: (pair_rows [P_pad] int64 flat pair index or -1, block_expert [P_pad/block_m]
    int32 local expert of each M-block); each present expert's pairs are contiguous and padded to block_m."""
    pairs, experts, counts = group_by_expert(expert_ids, expert_offset, num_local)
    device = expert_ids.device
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded  # padded start of each expert's run
    dest = torch.repeat_interleave(run_start, counts) + rank_in_group(counts)
    pair_rows = torch.full((int(padded.sum()),), -1, dtype=torch.int64, device=device)
    pair_rows[dest] = pairs
    block_expert = torch.repeat_interleave(experts, padded // block_m).to(torch.int32)
    return pair_rows, block_expert


def moe_mxfp4_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    expert_offset: int,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    block_m: int = 16,
    block_n: int = 32,
    block_kp: int = 16,
) -> torch.Tensor:
    """x [T, D] fp32/bf16, expert_ids [T, k], expert_weights [T, k], weights as in `reference.py` -> y [T, D] fp32.
    D and I must be multiples of 32 (MXFP4 blocks)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, top_k = expert_ids.shape
    num_local, two_inter, _ = w13_packed.shape
    inter = two_inter // 2
    dim = x.shape[1]
    xf = x.float().contiguous()
    w13p, w13s, w2p, w2s = (t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale))
    route_w = expert_weights.float().contiguous().view(-1)
    out = torch.zeros(num_tokens * top_k, dim, dtype=torch.float32, device=xf.device)
    pair_rows, block_expert = padded_expert_blocks(expert_ids, expert_offset, num_local, block_m)
    num_blocks = block_expert.numel()
    if num_blocks:
        act = torch.empty(pair_rows.numel(), inter, dtype=torch.float32, device=xf.device)
        _moe_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
            xf, pair_rows, block_expert, w13p, w13s, act,
            dim, inter, top_k, float(situ_beta), float(situ_linear_beta),
            xf.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), act.stride(0),
            ACT_SILU=activation == "silu", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
        )  # fmt: skip
        _moe_down_kernel[(num_blocks, triton.cdiv(dim, block_n))](
            act, pair_rows, block_expert, route_w, w2p, w2s, out,
            dim, inter,
            act.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
        )  # fmt: skip
    return out.view(num_tokens, top_k, dim).sum(1)

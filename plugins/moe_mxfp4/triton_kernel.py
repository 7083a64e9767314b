"""Triton MoEMXFP4 (semantics in `reference.py`): W4A16 grouped GEMM with MXFP4 dequantized in the kernel.

Host side (torch, any device, no host synchronization): the (token, choice) pairs routed to this rank are
sorted by local expert and each expert's run is padded to a multiple of BLOCK_M (padding = -1), so every M-block
has one expert. Every size is computed from shapes only (the pair layout has the static capacity
`pair_capacity`, blocks past the used ones are marked -1 and exit at once), so nothing is read back to the host
and the launches can be captured in a CUDA graph. Tokens run in chunks of at most `chunk_tokens`, which bounds
the scratch (`scratch_bytes`) at any step size.
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

from .reference import ACTIVATIONS

DEFAULT_SCRATCH_BUDGET = 256 * 2**20  # bytes of chunk scratch (partial sums + activations) per call


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
    if tl.load(block_expert_ptr + pid_m) < 0:  # past the used blocks (static grid)
        return
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
    if tl.load(block_expert_ptr + pid_m) < 0:  # past the used blocks (static grid)
        return
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


def pair_capacity(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the padded pair layout for `num_pairs` (token, choice) pairs: each of at most min(num_local,
    num_pairs) present experts pads its run by at most block_m - 1, rounded up to whole blocks."""
    return -(-(num_pairs + min(num_local, num_pairs) * (block_m - 1)) // block_m) * block_m


def padded_expert_blocks(expert_ids: torch.Tensor, expert_offset: int, num_local: int, block_m: int):
    """Pair layout for the kernels, sizes from shapes only (no host synchronization): (pair_rows [C] int64 flat pair
    index or -1, block_expert [C/block_m] int32 local expert of each M-block, -1 past the used blocks), C =
    `pair_capacity`; each present expert's pairs are contiguous, in pair order, and padded to block_m."""
    device = expert_ids.device
    num_pairs = expert_ids.numel()
    capacity = pair_capacity(num_pairs, num_local, block_m)
    local = expert_ids.reshape(-1).to(torch.int64) - expert_offset
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # off-rank pairs sort last
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rank = torch.arange(num_pairs, device=device) - first[key_sorted]
    start = torch.cat([run_end.new_zeros(1), run_end])  # padded run start; [num_local] = end of all runs
    dest = torch.where(key_sorted < num_local, start[key_sorted] + rank, capacity)  # off-rank: the spill row
    pair_rows = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
    pair_rows.scatter_(0, dest, order)
    block_start = torch.arange(0, capacity, block_m, device=device)
    expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(expert < num_local, expert, -1).to(torch.int32)
    return pair_rows[:capacity], block_expert


def chunk_tokens(top_k: int, dim: int, inter: int, budget_bytes: int) -> int:
    """Tokens per chunk so that one chunk's scratch fits `budget_bytes` (at least one token)."""
    per_token = 4 * top_k * (dim + inter)  # fp32 partial sums [k, D] and activations [k, I] per token
    return max(1, budget_bytes // per_token)


def _aligned(n: int) -> int:
    return -(-n // 256) * 256


def workspace_bytes(num_tokens: int, top_k: int, dim: int, inter: int, num_local: int, *, block_m: int = 16,
                    budget_bytes: int = 256 * 2**20) -> int:
    """Bytes of the caller-provided workspace (`moe_mxfp4_triton(workspace=...)`) for steps of up to
    `num_tokens`: the largest chunk's partial sums [Tc*k, D] fp32 and activations [C, I] fp32, 256-byte aligned
    (TensorRT engines declare it as the plugin's second output, so it lives in the engine's device memory)."""
    tc = min(num_tokens, chunk_tokens(top_k, dim, inter, budget_bytes))
    cap = pair_capacity(tc * top_k, num_local, block_m)
    return _aligned(4 * tc * top_k * dim) + _aligned(4 * cap * inter)


def scratch_bytes(num_tokens: int, top_k: int, dim: int, inter: int, num_local: int, *, block_m: int = 16,
                  budget_bytes: int) -> int:
    """Device scratch one MoEMXFP4 call takes (largest chunk): the workspace (partial sums, activations) and the
    pair layout [C] int64 + [C/block_m] int32, C = pair_capacity(Tc*k)."""
    tc = min(num_tokens, chunk_tokens(top_k, dim, inter, budget_bytes))
    cap = pair_capacity(tc * top_k, num_local, block_m)
    ws = workspace_bytes(num_tokens, top_k, dim, inter, num_local, block_m=block_m, budget_bytes=budget_bytes)
    return ws + 8 * cap + 4 * (cap // block_m)


def _buffers(workspace: torch.Tensor | None, pairs: int, dim: int, rows: int, inter: int, device):
    """(partial [pairs, D] fp32, act [rows, I] fp32): views into `workspace` (uint8), or fresh tensors."""
    if workspace is None:
        return (torch.empty(pairs, dim, dtype=torch.float32, device=device),
                torch.empty(rows, inter, dtype=torch.float32, device=device))  # fmt: skip
    first = _aligned(4 * pairs * dim)
    need = first + 4 * rows * inter
    if workspace.numel() < need:
        raise ValueError(f"MoE workspace of {workspace.numel()} bytes, {need} needed")
    partial = workspace[: 4 * pairs * dim].view(torch.float32).view(pairs, dim)
    act = workspace[first : first + 4 * rows * inter].view(torch.float32).view(rows, inter)
    return partial, act


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
    budget_bytes: int = DEFAULT_SCRATCH_BUDGET,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] fp32/bf16, expert_ids [T, k], expert_weights [T, k], weights as in `reference.py` -> y [T, D] fp32
    (written into `out` when given). D and I must be multiples of 32 (MXFP4 blocks). `workspace`: uint8 device
    buffer of at least `workspace_bytes(T, ...)` holding the partial sums and activations (else allocated)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, top_k = expert_ids.shape
    num_local, two_inter, _ = w13_packed.shape
    inter = two_inter // 2
    dim = x.shape[1]
    w13p, w13s, w2p, w2s = (t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale))
    y = torch.empty(num_tokens, dim, dtype=torch.float32, device=x.device) if out is None else out
    step = chunk_tokens(top_k, dim, inter, budget_bytes)
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        xf = x[t0:t1].float().contiguous()
        ids = expert_ids[t0:t1]
        route_w = expert_weights[t0:t1].float().contiguous().view(-1)
        pair_rows, block_expert = padded_expert_blocks(ids, expert_offset, num_local, block_m)
        num_blocks = block_expert.numel()
        partial, act = _buffers(workspace, (t1 - t0) * top_k, dim, pair_rows.numel(), inter, x.device)
        partial.zero_()  # pairs routed to other ranks contribute zeros
        if num_blocks:
            _moe_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
                xf, pair_rows, block_expert, w13p, w13s, act,
                dim, inter, top_k, float(situ_beta), float(situ_linear_beta),
                xf.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), act.stride(0),
                ACT_SILU=activation == "silu", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
            )  # fmt: skip
            _moe_down_kernel[(num_blocks, triton.cdiv(dim, block_n))](
                act, pair_rows, block_expert, route_w, w2p, w2s, partial,
                dim, inter,
                act.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), partial.stride(0),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
            )  # fmt: skip
        torch.sum(partial.view(t1 - t0, top_k, dim), 1, out=y[t0:t1])
    return y

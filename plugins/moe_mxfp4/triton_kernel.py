"""Triton MoEMXFP4 (semantics in `reference.py`): W4A16 grouped GEMM, MXFP4 dequantized in registers.

Four launches (five when the up projection splits K), no host synchronization (every size comes from shapes, so
they run inside a TensorRT enqueue and a CUDA graph capture), tokens in chunks of at most `sizes.chunk_tokens`
(bounded workspace):
1. `_pair_layout_kernel` (one program): the (token, choice) pairs of the valid rows routed to this rank grouped by
   local expert once, each expert's run padded to BLOCK_M -> pair rows [C] (flat pair index, -1 = padding), the
   local expert of each used M-block and the used-block count [1] (on the device), C = `sizes.pair_capacity`.
2. `_moe_up_kernel`, grid (`sizes.block_programs`, I / BLOCK_N, split_up), each program looping over the used
   M-blocks: the block's token rows of x (bf16) gathered once per K step [BLOCK_M, BLOCK_K], its expert's gate and
   up rows [BLOCK_N, BLOCK_K] decoded from the kernel layout (`layout.py`: each 32-bit word, 4 bytes taken as
   one register, holds 8 values whose bits sit where a rotation and a mask make a bf16 pair; one bf16x2 multiply
   by 2^(s-1) per pair, the pairs written straight into the MMA operand's registers; inline PTX on the GPU, the
   same arithmetic in plain Triton under the interpreter) and fed to `tl.dot` (tensor-core MMA, fp32
   accumulation; decode tiles as w @ x^T, the decoded weights the A operand), the gated activation (SiLU or SiTU)
   fused in the epilogue -> act [C, I] bf16; with a K split, the split's gate and up sums -> pre [split, C, 2I]
   fp32 and `_moe_act_kernel` sums the splits (in order) and applies the activation -> act.
3. `_moe_down_kernel`, grid (the same rows, D / BLOCK_N, split_down): act @ W2^T the same way, times the routing
   weight -> the pair's row of partial [split_down, T*k, D] fp32.
4. `_combine_kernel`, grid (`sizes.combine_programs`, D / BLOCK_D), each program looping over the valid rows:
   y[t] = sum of token t's local pair rows over the splits, in y's dtype (deterministic: no atomics, and rows of
   pairs of other ranks are never read, so partial needs no zeroing).
Valid rows: every row, or with `recv_counts` (the MoE all-to-all's receive counts, wide expert parallelism) the
head [0, n) of the receive buffer, n = sum(recv_counts) read inside the kernels: the host only knows a bound
`row_bound` >= n, the chunks cover [0, row_bound), and the up / down / combine grids are fixed sizes (one M-block
program per expert that can be present, two combine programs per SM), so a decode step costs the same whatever
the buffer's rows; rows >= n are never read for anything that matters, nor written. Padding pair rows read token
0's x (or an unwritten act row): their columns of the accumulators are never stored.
Tiles (`tile_config`): prefill (many pairs per expert) BLOCK_M 64 x BLOCK_N 128 x BLOCK_K 128, 8 warps (wgmma),
3 stages; decode BLOCK_M 16 x BLOCK_N 64 x BLOCK_K 256, two warps of 32 weight rows (mma.sync, the token tile
shared by a warp's two row tiles), K split until every SM has a program. x is bf16 and so are y and the
activations: no fp32 variant (an fp32 tile of x needed more shared memory than a block has).
`benchmarks/sm90_report.py` shows what each tile compiles to (decode: under 3 SASS instructions per weight).
Runs on CUDA tensors or under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from ..triton_dot import INTERPRETED, mma
from .inputs import moe_inputs
from .sizes import (ACT_BLOCK_I, COMBINE_BLOCK_D, DEFAULT_SCRATCH_BUDGET, H200_SMS, aligned, block_programs,
                    chunk_tokens, combine_programs, pair_capacity, tile_config)

@triton.jit
def _words_asm(w, scale):
    """GPU: kernel-layout bytes (`layout.py`) [..., 4W] (4 per word, taken as one 32-bit register) and bf16x2
    scales 2^(s-1) [..., 4W] (equal over a word) -> (lo, hi) bf16 [..., 4W]: word j's values 8j .. 8j+3 at
    lo[4j .. 4j+3], 8j+4 .. 8j+7 at hi[4j .. 4j+3], each output register a bf16 pair (no 16-bit moves): per
    pair one mask after a rotation (none for pair 0; two rotations and masks for pair 3) and one bf16x2 multiply."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u;
        and.b32 $0, $4, 0x81c081c0;
        mul.rn.bf16x2 $0, $0, $5;
        shf.l.wrap.b32 t, $4, $4, 4;
        and.b32 $1, t, 0x81c081c0;
        mul.rn.bf16x2 $1, $1, $5;
        shf.l.wrap.b32 t, $4, $4, 10;
        and.b32 $2, t, 0x81c081c0;
        mul.rn.bf16x2 $2, $2, $5;
        shf.l.wrap.b32 t, $4, $4, 6;
        and.b32 t, t, 0x80c080c0;
        shf.l.wrap.b32 u, $4, $4, 14;
        and.b32 u, u, 0x01000100;
        or.b32 $3, t, u;
        mul.rn.bf16x2 $3, $3, $5;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r", args=[w, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
        pack=4)  # fmt: skip


@triton.jit
def _rotl(word, r: tl.constexpr):
    """Interpreter: uint32 `word` rotated left by r bits (PTX shf.l.wrap)."""
    return (word << r) | (word >> (32 - r))


@triton.jit
def _lane(pairs, lane, scale):
    """Interpreter: lane `lane` (0 low, 1 high) of bf16 pair bits (uint32) times the scale lane -> bf16, both
    widened to fp32 bits (exact, subnormals kept), multiplied in fp32 (exact: two bf16 significands) and rounded
    once, as mul.rn.bf16x2 does (the interpreter's bf16 multiply works on raw integers)."""
    sc = ((scale & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    v = (((pairs >> (16 * lane)) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return (v * sc).to(tl.bfloat16)


@triton.jit
def _words_interpreted(w, scale, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """`_words_asm` in plain Triton ops (the interpreter runs no inline PTX): w uint8 [BLOCK_N, 4 WORDS], the
    same rotations and masks on each little-endian word, the same (lo, hi) order."""
    byte = tl.arange(0, 4)[None, None, :]
    word = tl.sum(w.to(tl.uint32).reshape(BLOCK_N, WORDS, 4) << (8 * byte), axis=2)[:, :, None]
    word = tl.broadcast_to(word, [BLOCK_N, WORDS, 4])
    p0 = word & 0x81C081C0
    p1 = _rotl(word, 4) & 0x81C081C0
    p2 = _rotl(word, 10) & 0x81C081C0
    p3 = (_rotl(word, 6) & 0x80C080C0) | (_rotl(word, 14) & 0x01000100)
    lane = byte % 2
    sc = scale.reshape(BLOCK_N, WORDS, 4)
    lo = _lane(tl.where(byte < 2, p0, p1), lane, sc).reshape(BLOCK_N, WORDS * 4)
    hi = _lane(tl.where(byte < 2, p2, p3), lane, sc).reshape(BLOCK_N, WORDS * 4)
    return lo, hi


@triton.jit
def _mxfp4_tile(w_ptrs, s_ptrs, w_mask, s_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                INTERPRETED_: tl.constexpr):  # fmt: skip
    """Weight tile [BLOCK_N, BLOCK_K] bf16 from w_ptrs -> bytes [BLOCK_N, BLOCK_K/2] of the kernel layout and
    s_ptrs -> E8M0 scale bytes [BLOCK_N, BLOCK_K/32] (<= 128, `layout.check_scales`); the masks are not applied
    when EVEN (the tile lies inside the weights)."""
    if EVEN:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs).to(tl.uint32)
    else:
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        s = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.uint32)
    scale = tl.broadcast_to(((s + 126) * 0x00800080)[:, :, None], [BLOCK_N, BLOCK_K // 32, 16])  # bf16 2^(s-1) x2
    scale = scale.reshape(BLOCK_N, BLOCK_K // 2)
    if INTERPRETED_:
        lo, hi = _words_interpreted(w, scale, BLOCK_N, BLOCK_K // 8)
    else:
        lo, hi = _words_asm(w, scale)
    values = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K // 8, 4, 2).permute(0, 1, 3, 2)  # [word, half, value]
    return values.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHTS_LEFT: tl.constexpr):
    """A zero accumulator: [BLOCK_N, BLOCK_M] fp32 when WEIGHTS_LEFT (weights x tokens), else [BLOCK_M, BLOCK_N]."""
    if WEIGHTS_LEFT:  # one branch is compiled (a constexpr): its shape is the result's
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return acc


@triton.jit
def _mma_tile(w, a, acc, WEIGHTS_LEFT: tl.constexpr, UPCAST: tl.constexpr):
    """acc + one K step, decoded weights w [BLOCK_N, BLOCK_K] and tokens a [BLOCK_M, BLOCK_K]: w @ a^T (decode
    tiles: the weights are the A operand, decoded straight into its registers, 16 tokens the N of the MMA) or
    a @ w^T (prefill: the wgmma tiles of 64 or 128 tokens)."""
    if WEIGHTS_LEFT:
        acc = mma(w, tl.trans(a), acc, UPCAST)
    else:
        acc = mma(a, tl.trans(w), acc, UPCAST)
    return acc


@triton.jit
def _weight_rows(acc, WEIGHTS_LEFT: tl.constexpr):
    """The accumulator as [BLOCK_N, BLOCK_M] (weight rows x tokens) for the epilogue."""
    if not WEIGHTS_LEFT:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _valid_rows(counts_ptr, num_counts, row_start, rows, COUNTED: tl.constexpr, BLOCK_S: tl.constexpr):
    """Valid rows of a chunk of `rows` rows starting at buffer row `row_start`: all of them, or (COUNTED) those
    below n = sum(counts[0:num_counts]), read on the device."""
    valid = rows
    if COUNTED:
        offs_s = tl.arange(0, BLOCK_S)
        n = tl.sum(tl.load(counts_ptr + offs_s, mask=offs_s < num_counts, other=0).to(tl.int64), axis=0)
        valid = tl.minimum(tl.maximum(n - row_start, 0), rows).to(tl.int32)
    return valid


@triton.jit
def _pair_layout_kernel(ids_ptr, counts_ptr, pair_rows_ptr, block_expert_ptr, num_blocks_ptr,
                        num_rows, top_k, num_counts, row_start, expert_offset, num_local,
                        COUNTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_S: tl.constexpr):  # fmt: skip
    """One program over the pairs of the valid rows: count the local pairs per expert, pad the runs, write the
    used blocks' experts, the padding rows and the used-block count, then place every local pair at run start +
    its rank among the expert's pairs (pair order kept)."""
    num_pairs = _valid_rows(counts_ptr, num_counts, row_start, num_rows, COUNTED, BLOCK_S) * top_k
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        e = tl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(tl.int32) - expert_offset
        hit = (e[:, None] == offs_e[None, :]) & (offs_p < num_pairs)[:, None] & (offs_e < num_local)[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    used_rows = tl.sum(padded, axis=0)
    tl.store(num_blocks_ptr, used_rows // BLOCK_M)
    for r0 in range(0, used_rows, BLOCK_P):  # the used blocks' experts and padding rows
        rows = r0 + tl.arange(0, BLOCK_P)
        ex = tl.sum(((run_end[None, :] <= rows[:, None]) & (offs_e < num_local)[None, :]).to(tl.int32), axis=1)
        own = (ex[:, None] == offs_e[None, :]).to(tl.int32)
        used = rows - tl.sum(own * run_start[None, :], axis=1) < tl.sum(own * counts[None, :], axis=1)
        tl.store(pair_rows_ptr + rows, -1, mask=(rows < used_rows) & ~used)
        tl.store(block_expert_ptr + rows // BLOCK_M, ex, mask=(rows % BLOCK_M == 0) & (rows < used_rows))
    seen = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        e = tl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(tl.int32) - expert_offset
        hit = ((e[:, None] == offs_e[None, :]) & (offs_p < num_pairs)[:, None] & (offs_e < num_local)[None, :])
        hit = hit.to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in this block
        dest = tl.sum(hit * (run_start + seen + before), axis=1)
        tl.store(pair_rows_ptr + dest, offs_p.to(tl.int64), mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)


@triton.jit
def _moe_up_kernel(
    x_ptr, pair_ptr, block_expert_ptr, num_blocks_ptr, w_ptr, s_ptr, act_ptr, pre_ptr,
    dim, inter, top_k, situ_beta, situ_linear_beta, split_steps,
    stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_at, stride_ps, stride_pm,
    ACT_SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, SPLIT: tl.constexpr, WEIGHTS_LEFT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (i, j, s): N tile j of the used M-blocks i, i + grid rows, ... (the count read on the device), over
    K split s (`split_steps` K steps each) when SPLIT: then the gate and up sums go to pre [s, C, 2I] fp32 (the
    activation is `_moe_act_kernel`'s), else the activation to act. EVEN: BLOCK_K divides D and BLOCK_N divides I
    (no masks on the K steps)."""
    k_begin, k_end = 0, dim
    if SPLIT:
        k_begin = tl.program_id(2) * split_steps * BLOCK_K
        k_end = tl.minimum(dim, k_begin + split_steps * BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k, offs_ks = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 32)
    offs_kb = tl.arange(0, BLOCK_K // 2)  # bytes of a K step
    mask_n = offs_n < inter
    g_rows, u_rows = offs_n[:, None], offs_n[:, None] + inter
    for block in range(tl.program_id(0), tl.load(num_blocks_ptr), tl.num_programs(0)):
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + offs_m)
        valid_m = pair >= 0
        token = tl.where(valid_m, pair // top_k, 0)
        w_g = w_ptr + expert * stride_we + g_rows * stride_wr + offs_kb[None, :]
        w_u = w_ptr + expert * stride_we + u_rows * stride_wr + offs_kb[None, :]
        s_g = s_ptr + expert * stride_se + g_rows * stride_sr + offs_ks[None, :]
        s_u = s_ptr + expert * stride_se + u_rows * stride_sr + offs_ks[None, :]
        x_rows = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        acc_g = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_LEFT)
        acc_u = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_LEFT)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if EVEN:
                a = tl.load(x_rows + k0)  # padding rows read token 0 (never stored)
            else:
                a = tl.load(x_rows + k0, mask=(k0 + offs_k < dim)[None, :], other=0.0)
            w_mask = mask_n[:, None] & (k0 // 2 + offs_kb < dim // 2)[None, :]
            s_mask = mask_n[:, None] & (k0 // 32 + offs_ks < dim // 32)[None, :]
            wg = _mxfp4_tile(w_g + k0 // 2, s_g + k0 // 32, w_mask, s_mask, BLOCK_N, BLOCK_K, EVEN, UPCAST)
            wu = _mxfp4_tile(w_u + k0 // 2, s_u + k0 // 32, w_mask, s_mask, BLOCK_N, BLOCK_K, EVEN, UPCAST)
            acc_g = _mma_tile(wg, a, acc_g, WEIGHTS_LEFT, UPCAST)
            acc_u = _mma_tile(wu, a, acc_u, WEIGHTS_LEFT, UPCAST)
        acc_g, acc_u = _weight_rows(acc_g, WEIGHTS_LEFT), _weight_rows(acc_u, WEIGHTS_LEFT)
        store = valid_m[None, :] & mask_n[:, None]
        if SPLIT:
            pre = pre_ptr + tl.program_id(2) * stride_ps + offs_m[None, :] * stride_pm + offs_n[:, None]
            tl.store(pre, acc_g, mask=store)
            tl.store(pre + inter, acc_u, mask=store)
        else:
            act = _activate(acc_g, acc_u, situ_beta, situ_linear_beta, ACT_SILU)
            tl.store(act_ptr + offs_m[None, :] * stride_at + offs_n[:, None], act.to(act_ptr.dtype.element_ty),
                     mask=store)  # fmt: skip


@triton.jit
def _activate(acc_g, acc_u, situ_beta, situ_linear_beta, ACT_SILU: tl.constexpr):
    """The gated activation of fp32 gate and up sums (`reference.py`): SiLU(g) * u, or SiTU."""
    sig = 1.0 / (1.0 + tl.exp(-acc_g))
    if ACT_SILU:
        return acc_g * sig * acc_u
    tanh_g = 2.0 / (1.0 + tl.exp(-2.0 * acc_g / situ_beta)) - 1.0
    tanh_u = 2.0 / (1.0 + tl.exp(-2.0 * acc_u / situ_linear_beta)) - 1.0
    return situ_beta * tanh_g * sig * (situ_linear_beta * tanh_u)


@triton.jit
def _moe_act_kernel(pre_ptr, pair_ptr, num_blocks_ptr, act_ptr, inter, splits, situ_beta, situ_linear_beta,
                    stride_ps, stride_pm, stride_at,
                    ACT_SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):  # fmt: skip
    """After a split up projection: program (i, j) -> act[r, cols j] for the used pair rows r = i, i + grid rows,
    ... = the activation of the sums over the splits of pre[s, r] (gate, then up at + I), in split order."""
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    for r in range(tl.program_id(0), tl.load(num_blocks_ptr) * BLOCK_M, tl.num_programs(0)):
        if tl.load(pair_ptr + r) >= 0:
            acc_g = tl.zeros([BLOCK_I], tl.float32)
            acc_u = tl.zeros([BLOCK_I], tl.float32)
            for s in range(splits):
                pre = pre_ptr + s * stride_ps + r * stride_pm + offs
                acc_g += tl.load(pre, mask=offs < inter, other=0.0)
                acc_u += tl.load(pre + inter, mask=offs < inter, other=0.0)
            act = _activate(acc_g, acc_u, situ_beta, situ_linear_beta, ACT_SILU)
            tl.store(act_ptr + r * stride_at + offs, act.to(act_ptr.dtype.element_ty), mask=offs < inter)


@triton.jit
def _moe_down_kernel(
    act_ptr, pair_ptr, block_expert_ptr, num_blocks_ptr, route_w_ptr, w_ptr, s_ptr, out_ptr,
    dim, inter, split_steps,
    stride_at, stride_we, stride_wr, stride_se, stride_sr, stride_ot, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (i, j, s): N tile j of the used M-blocks i, i + grid rows, ... -> rows of partial for their pairs
    (split s's rows at + s * stride_os, over its `split_steps` K steps, when SPLIT). EVEN: BLOCK_K divides I and
    BLOCK_N divides D (no masks on the K steps)."""
    k_begin, k_end = 0, inter
    if SPLIT:
        k_begin = tl.program_id(2) * split_steps * BLOCK_K
        k_end = tl.minimum(inter, k_begin + split_steps * BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k, offs_ks = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 32)
    offs_kb = tl.arange(0, BLOCK_K // 2)  # bytes of a K step
    mask_n = offs_n < dim
    for block in range(tl.program_id(0), tl.load(num_blocks_ptr), tl.num_programs(0)):
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + offs_m)
        valid_m = pair >= 0
        w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wr + offs_kb[None, :]
        s_rows = s_ptr + expert * stride_se + offs_n[:, None] * stride_sr + offs_ks[None, :]
        a_rows = act_ptr + offs_m[:, None] * stride_at + offs_k[None, :]
        acc = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_LEFT)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if EVEN:
                a = tl.load(a_rows + k0)  # padding rows: their columns of acc are never stored
            else:
                a = tl.load(a_rows + k0, mask=(k0 + offs_k < inter)[None, :], other=0.0)
            w_mask = mask_n[:, None] & (k0 // 2 + offs_kb < inter // 2)[None, :]
            s_mask = mask_n[:, None] & (k0 // 32 + offs_ks < inter // 32)[None, :]
            w = _mxfp4_tile(w_rows + k0 // 2, s_rows + k0 // 32, w_mask, s_mask, BLOCK_N, BLOCK_K, EVEN, UPCAST)
            acc = _mma_tile(w, a, acc, WEIGHTS_LEFT, UPCAST)
        acc = _weight_rows(acc, WEIGHTS_LEFT)
        rows = tl.where(valid_m, pair, 0)
        acc = acc * tl.load(route_w_ptr + rows, mask=valid_m, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[None, :] * stride_ot + offs_n[:, None]
        if SPLIT:
            out += tl.program_id(2) * stride_os
        tl.store(out, acc, mask=valid_m[None, :] & mask_n[:, None])


@triton.jit
def _combine_kernel(partial_ptr, ids_ptr, counts_ptr, y_ptr, num_rows, num_counts, row_start, dim, top_k,
                    expert_offset, num_local, splits, stride_pt, stride_ps, stride_yt,
                    COUNTED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """Program (i, j): y[t, cols j] for the valid rows t = i, i + grid rows, ... = sum of row t's choices routed
    to this rank of partial[t*k + c, cols] over the down projection's K splits (at + s * stride_ps, in split
    order; 0 if none); rows past the valid ones are not written."""
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    valid = _valid_rows(counts_ptr, num_counts, row_start, num_rows, COUNTED, BLOCK_S)
    for t in range(tl.program_id(0), valid, tl.num_programs(0)):
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j in range(top_k):
            local = tl.load(ids_ptr + t * top_k + j) - expert_offset
            if (local >= 0) & (local < num_local):
                for s in range(splits):
                    acc += tl.load(partial_ptr + s * stride_ps + (t * top_k + j) * stride_pt + offs, mask=offs < dim,
                                   other=0.0)  # fmt: skip
        tl.store(y_ptr + t * stride_yt + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < dim)


def _counts_args(recv_counts: torch.Tensor | None, row_start: int) -> dict:
    """The kernels' view of `recv_counts` for a chunk starting at buffer row `row_start`."""
    num_counts = 0 if recv_counts is None else recv_counts.numel()
    return dict(counts_ptr=recv_counts, num_counts=num_counts, row_start=row_start, COUNTED=recv_counts is not None,
                BLOCK_S=triton.next_power_of_2(max(num_counts, 2)))  # fmt: skip


def pair_layout(expert_ids: torch.Tensor, expert_offset: int, num_local: int, block_m: int,
                pair_rows: torch.Tensor | None = None, block_expert: torch.Tensor | None = None,
                num_blocks: torch.Tensor | None = None, *, recv_counts: torch.Tensor | None = None,
                row_start: int = 0):  # fmt: skip
    """expert_ids [T, k] (global ids) -> (pair_rows [C] int64, block_expert [C / block_m] int32, num_blocks [1]
    int32), C = `pair_capacity(T*k, num_local, block_m)`: each present local expert's pairs contiguous, in pair
    order, padded to block_m with -1, over the first num_blocks blocks (the rest is not written). With
    `recv_counts` only the rows below sum(recv_counts) - row_start are read (on the device). Written into the
    given buffers when passed."""
    num_rows, top_k = expert_ids.shape
    capacity = pair_capacity(num_rows * top_k, num_local, block_m)
    device = expert_ids.device
    pair_rows = torch.empty(capacity, dtype=torch.int64, device=device) if pair_rows is None else pair_rows
    block_expert = (torch.empty(capacity // block_m, dtype=torch.int32, device=device)
                    if block_expert is None else block_expert)  # fmt: skip
    num_blocks = torch.empty(1, dtype=torch.int32, device=device) if num_blocks is None else num_blocks
    if capacity:
        block_e = triton.next_power_of_2(max(num_local, 2))
        _pair_layout_kernel[(1,)](
            expert_ids.contiguous(), pair_rows_ptr=pair_rows, block_expert_ptr=block_expert, num_blocks_ptr=num_blocks,
            num_rows=num_rows, top_k=top_k, expert_offset=expert_offset, num_local=num_local,
            BLOCK_M=block_m, BLOCK_P=max(16, min(256, 8192 // block_e)), BLOCK_E=block_e,
            **_counts_args(recv_counts, row_start),
        )  # fmt: skip
    return pair_rows, block_expert, num_blocks


def _workspace_views(workspace, pairs: int, dim: int, cap: int, inter: int, act_dtype, block_m: int, splits,
                     device):  # fmt: skip
    """(partial [split_down, pairs, D] fp32, act [C, I], pre [split_up, C, 2I] fp32 (no rows without an up split),
    pair_rows [C] int64, block_expert [C / block_m] int32, num_blocks [1] int32) for splits (split_up,
    split_down): views into the uint8 `workspace` (laid out as `sizes.workspace_bytes` counts), or fresh
    tensors."""
    split_up, split_down = splits
    shapes = [((split_down, pairs, dim), torch.float32), ((cap, inter), act_dtype),
              ((split_up if split_up > 1 else 0, cap, 2 * inter), torch.float32), ((cap,), torch.int64),
              ((cap // block_m,), torch.int32), ((1,), torch.int32)]  # fmt: skip
    if workspace is None:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    sizes = [aligned(dtype.itemsize * int(torch.Size(shape).numel())) for shape, dtype in shapes]
    if workspace.numel() < sum(sizes):
        raise ValueError(f"MoE workspace of {workspace.numel()} bytes, {sum(sizes)} needed")
    views, at = [], 0
    for (shape, dtype), size in zip(shapes, sizes):
        n = dtype.itemsize * int(torch.Size(shape).numel())
        views.append(workspace[at : at + n].view(dtype).view(shape))
        at += size
    return views


def _rows_to_run(num_tokens: int, recv_counts: torch.Tensor | None, row_bound: int | None, device) -> int:
    """The rows the chunk loop covers: all `num_tokens`, or with `recv_counts` the first `row_bound`."""
    if recv_counts is None:
        if row_bound is not None:
            raise ValueError("moe_mxfp4_triton: row_bound is given without recv_counts")
        return num_tokens
    if recv_counts.dim() != 1 or recv_counts.dtype not in (torch.int32, torch.int64) or recv_counts.device != device:
        raise ValueError(f"moe_mxfp4_triton: recv_counts must be a 1-D int32/int64 tensor on {device}, got "
                         f"{recv_counts.dtype} {tuple(recv_counts.shape)} on {recv_counts.device}")  # fmt: skip
    bound = num_tokens if row_bound is None else row_bound
    if not 0 <= bound <= num_tokens:
        raise ValueError(f"moe_mxfp4_triton: row_bound {row_bound} outside 0..{num_tokens} (the buffer's rows)")
    return bound


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
    tiles: dict | None = None,
    budget_bytes: int = DEFAULT_SCRATCH_BUDGET,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    recv_counts: torch.Tensor | None = None,
    row_bound: int | None = None,
) -> torch.Tensor:
    """x [T, D] bf16 (ValueError otherwise), expert_ids [T, k], expert_weights [T, k], the weights of `reference.py`
    with the packed bytes in the kernel layout (`layout.kernel_experts`: block scales at most 2) -> y [T, D] bf16
    (written into `out` when given, any float dtype). D and I multiples of 32 (MXFP4 blocks). `tiles`: `tile_config`'s keys (default: chosen
    per chunk). `workspace`: uint8 device buffer of at least `sizes.workspace_bytes(T, ...)` (else allocated).
    Every row is valid unless `recv_counts` [S] int (on x's device) is given: then only rows [0, n), n =
    sum(recv_counts) read on the device, are read and written (rows >= n may hold anything, y's are left as they
    are), the chunks cover rows [0, row_bound) only (row_bound >= n, default T) and the grids are bounded
    (`sizes.block_programs`, `sizes.combine_programs`), whatever T."""
    num_tokens, top_k, _, inter, dim = moe_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale, w2_packed,
                                                  w2_scale, activation)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"moe_mxfp4_triton: x must be bf16 (the tensor-core path, bf16 in and out), got {x.dtype}")
    bound = _rows_to_run(num_tokens, recv_counts, row_bound, x.device)
    x = x[:bound]
    experts = [t.contiguous() for t in (w13_packed, w13_scale, w2_packed, w2_scale)]
    y = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device) if out is None else out
    step = chunk_tokens(top_k, dim, inter, budget_bytes)
    betas = (float(situ_beta), float(situ_linear_beta))
    for t0 in range(0, bound, step):
        t1 = min(bound, t0 + step)
        _run_chunk(x[t0:t1].contiguous(), expert_ids[t0:t1].contiguous(),
                   expert_weights[t0:t1].contiguous().view(-1), experts, y[t0:t1],
                   expert_offset=expert_offset, activation=activation, betas=betas, tiles=tiles, workspace=workspace,
                   recv_counts=recv_counts, row_start=t0)  # fmt: skip
    return y


def _run_chunk(x, ids, route_w, experts, y, *, expert_offset, activation, betas, tiles, workspace, recv_counts,
               row_start):  # fmt: skip
    """The four launches (five with an up split) over one chunk: x [Tc, D], ids [Tc, k], route_w [Tc*k] -> y
    [Tc, D] (a view)."""
    w13p, w13s, w2p, w2s = experts
    (num_rows, top_k), (num_local, two_inter, _), dim = ids.shape, w13p.shape, x.shape[1]
    inter, counted = two_inter // 2, recv_counts is not None
    cfg = tiles or tile_config(ids.numel(), num_local, dim, inter)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    launch = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    split_up, split_down = cfg.get("split_up", 1), cfg.get("split_down", 1)
    cap = pair_capacity(ids.numel(), num_local, bm)
    partial, act, pre, pair_rows, block_expert, num_blocks = _workspace_views(
        workspace, ids.numel(), dim, cap, inter, x.dtype, bm, (split_up, split_down), x.device)
    if cap:
        pair_layout(ids, expert_offset, num_local, bm, pair_rows, block_expert, num_blocks, recv_counts=recv_counts,
                    row_start=row_start)  # fmt: skip
        grid_m = block_programs(ids.numel(), num_local, bm, counted)
        silu = activation == "silu"
        steps_up, steps_down = triton.cdiv(triton.cdiv(dim, bk), split_up), triton.cdiv(triton.cdiv(inter, bk), split_down)
        _moe_up_kernel[(grid_m, triton.cdiv(inter, bn), split_up)](
            x, pair_rows, block_expert, num_blocks, w13p, w13s, act, pre,
            dim, inter, top_k, *betas, steps_up,
            x.stride(0), w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), act.stride(0),
            pre.stride(0), pre.stride(1),
            ACT_SILU=silu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=dim % bk == 0 and inter % bn == 0,
            SPLIT=split_up > 1, WEIGHTS_LEFT=bm < 64, UPCAST=INTERPRETED, **launch,
        )  # fmt: skip
        if split_up > 1:
            _moe_act_kernel[(min(cap, 2 * H200_SMS), triton.cdiv(inter, ACT_BLOCK_I))](
                pre, pair_rows, num_blocks, act, inter, split_up, *betas, pre.stride(0), pre.stride(1), act.stride(0),
                ACT_SILU=silu, BLOCK_M=bm, BLOCK_I=ACT_BLOCK_I,
            )  # fmt: skip
        _moe_down_kernel[(grid_m, triton.cdiv(dim, bn), split_down)](
            act, pair_rows, block_expert, num_blocks, route_w, w2p, w2s, partial,
            dim, inter, steps_down,
            act.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), partial.stride(1),
            partial.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=inter % bk == 0 and dim % bn == 0, SPLIT=split_down > 1,
            WEIGHTS_LEFT=bm < 64, UPCAST=INTERPRETED, **launch,
        )  # fmt: skip
    _combine_kernel[(combine_programs(num_rows, dim, counted), triton.cdiv(dim, COMBINE_BLOCK_D))](
        partial, ids, y_ptr=y, num_rows=num_rows, dim=dim, top_k=top_k, expert_offset=expert_offset,
        num_local=num_local, splits=split_down, stride_pt=partial.stride(1), stride_ps=partial.stride(0),
        stride_yt=y.stride(0), BLOCK_D=COMBINE_BLOCK_D,
        **_counts_args(recv_counts, row_start),
    )  # fmt: skip

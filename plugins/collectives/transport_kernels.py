"""Triton kernels of the MoE all-to-all's device side (`all_to_all.torch_dispatch_into` / `torch_combine_into`).

Five launches per MoE layer, no host value read (every grid comes from shapes and the host's transport):
1. `_route_kernel` (one program, two passes over blocks of tokens): from ids [T, K] and the device count of real
   tokens `valid` [1] -> send_counts [ep] (tokens to each rank), send_rows [T * K] (the sent row of a token's
   first choice on each rank, -1 for its other choices and for tokens at or past `valid`; blocks: d * B + slot,
   counted: the exclusive cumsum of send_counts + slot) and routed [E] (the live tokens' choices per expert);
2. `_pack_kernel`, grid (T,): token t's packed row (activation bytes, K int32 ids, K fp32 weights, little-endian;
   `all_to_all.packed_row_bytes` wide) written at each of its sent rows of the send buffer; nothing else written;
3. `_unpack_kernel`, grid (ep, B) blocks or (R,) counted: the received rows -> the head of recv_x, recv_ids
   (int64), recv_w (fp32): source s's row j < recv_counts[s] of its block to start_s + j; counted rows stay;
4. `_expand_kernel`, grid (ep, B) (combine, blocks): head row start_s + j of the partial sums -> row s * B + j of
   the blocks sent back, j < recv_counts[s];
5. `_sum_kernel`, grid (T, D / BLOCK_D): out[t] = sum over k of the returned row send_rows[t * K + k] (those
   >= 0), fp32 accumulation in choice order (deterministic, no atomics), 0 for a token with none, in out's dtype.
Runs on CUDA tensors or under TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

KERNELS = ("_route_kernel", "_pack_kernel", "_unpack_kernel", "_expand_kernel", "_sum_kernel")  # launched here
_TILE = 4096  # elements of the routing kernel's largest block tile
_HISTOGRAM_PAIRS = 512  # (token, choice) pairs per step of the routed counts
_BLOCK_BYTES = 1024  # bytes of a row copied per step
_BLOCK_D = 256  # columns per program of the sum


@triton.jit
def _first_dest(ids_ptr, t0, num_tokens, valid, top_k, experts_per_rank, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """(dest [BLOCK_T, BLOCK_K] int64, tokens [BLOCK_T], choices [BLOCK_K]) of tokens t0..: the rank of choice k
    where it is the token's first on that rank and the token is below `valid`, else -1."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    inside = (offs_t < num_tokens)[:, None] & (offs_k < top_k)[None, :]
    ids = tl.load(ids_ptr + offs_t[:, None] * top_k + offs_k[None, :], mask=inside, other=0).to(tl.int64)
    dest = ids // experts_per_rank
    earlier = (offs_k[None, :] < offs_k[:, None])[None, :, :]  # [1, k, j]: j < k
    repeat = tl.sum(((dest[:, :, None] == dest[:, None, :]) & earlier).to(tl.int32), axis=2) > 0
    first = inside & ~repeat & (offs_t < valid)[:, None]
    return tl.where(first, dest, -1), offs_t, offs_k


@triton.jit
def _route_kernel(ids_ptr, valid_ptr, send_counts_ptr, send_rows_ptr, routed_ptr,
                  num_tokens, top_k, ep, num_experts, experts_per_rank, block_rows,
                  BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_EP: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """One program: send_counts, then send_rows (slots counted in token order per rank), then routed."""
    valid = tl.minimum(tl.load(valid_ptr).to(tl.int64), num_tokens)
    offs_d = tl.arange(0, BLOCK_EP)
    counts = tl.zeros([BLOCK_EP], tl.int64)
    for t0 in range(0, num_tokens, BLOCK_T):
        dest, offs_t, offs_k = _first_dest(ids_ptr, t0, num_tokens, valid, top_k, experts_per_rank, BLOCK_T, BLOCK_K)
        counts += tl.sum(tl.sum((dest[:, :, None] == offs_d[None, None, :]).to(tl.int64), axis=1), axis=0)
    tl.store(send_counts_ptr + offs_d, counts, mask=offs_d < ep)
    if BLOCKS:
        base = offs_d.to(tl.int64) * block_rows
    else:
        base = tl.cumsum(counts, axis=0) - counts
    seen = tl.zeros([BLOCK_EP], tl.int64)
    for t0 in range(0, num_tokens, BLOCK_T):
        dest, offs_t, offs_k = _first_dest(ids_ptr, t0, num_tokens, valid, top_k, experts_per_rank, BLOCK_T, BLOCK_K)
        hit = (dest[:, :, None] == offs_d[None, None, :]).to(tl.int64)  # [T, K, ep]
        goes = tl.sum(hit, axis=1)  # [T, ep]: 0 or 1
        at = base[None, :] + seen[None, :] + tl.cumsum(goes, axis=0) - goes  # the row of (token, rank)
        row = tl.sum(hit * at[:, None, :], axis=2)
        inside = (offs_t < num_tokens)[:, None] & (offs_k < top_k)[None, :]
        tl.store(send_rows_ptr + offs_t[:, None] * top_k + offs_k[None, :], tl.where(dest >= 0, row, -1), mask=inside)
        seen += tl.sum(goes, axis=0)
    pairs = valid * top_k  # a live token's pairs come first: ids are row-major
    routed = tl.zeros([BLOCK_E], tl.int64)
    for p0 in range(0, pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < pairs, other=0).to(tl.int32)
        routed += tl.histogram(ids, BLOCK_E, mask=offs_p < pairs).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(routed_ptr + offs_e, routed, mask=offs_e < num_experts)


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, w_ptr, send_rows_ptr, send_ptr, top_k, x_bytes, row_bytes,
                 BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Program t: token t's packed row at its sent rows (x_ptr: its bytes, row-major [T, x_bytes])."""
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.load(send_rows_ptr + t * top_k + offs_k, mask=offs_k < top_k, other=-1)
    sent = rows >= 0
    dst = send_ptr + tl.where(sent, rows, 0) * row_bytes  # [K]
    for b0 in range(0, x_bytes, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        inside = offs_b < x_bytes
        v = tl.load(x_ptr + t * x_bytes + offs_b, mask=inside, other=0)
        tl.store(dst[:, None] + offs_b[None, :], tl.broadcast_to(v[None, :], (BLOCK_K, BLOCK_B)),
                 mask=sent[:, None] & inside[None, :])  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)  # the ids' bytes, then the weights'
    word = offs_m // 4
    is_id = word < top_k
    ids = tl.load(ids_ptr + t * top_k + word, mask=is_id, other=0).to(tl.int32)
    weights = tl.load(w_ptr + t * top_k + word - top_k, mask=~is_id & (word < 2 * top_k), other=0.0)
    bits = tl.where(is_id, ids, weights.to(tl.float32).to(tl.int32, bitcast=True))
    byte = ((bits >> ((offs_m % 4) * 8)) & 255).to(tl.uint8)
    tl.store(dst[:, None] + x_bytes + offs_m[None, :], tl.broadcast_to(byte[None, :], (BLOCK_K, BLOCK_M)),
             mask=sent[:, None] & (offs_m < 8 * top_k)[None, :])  # fmt: skip


@triton.jit
def _block_row(counts_ptr, ep, block_rows, BLOCK_EP: tl.constexpr):
    """Program (s, j) of a (ep, B) grid: (row s * B + j of the blocks, head row start_s + j, j < counts[s])."""
    s, j = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_EP)
    counts = tl.load(counts_ptr + offs_d, mask=offs_d < ep, other=0).to(tl.int64)
    start = tl.sum(tl.where(offs_d < s, counts, 0), axis=0)
    count = tl.sum(tl.where(offs_d == s, counts, 0), axis=0)
    return s.to(tl.int64) * block_rows + j, start + j, j < count


@triton.jit
def _word(row_ptr, offs_k):
    """The little-endian 32-bit words [K] at byte offsets 4 * offs_k of a row, as int32."""
    word = tl.load(row_ptr + 4 * offs_k).to(tl.int32)
    for b in tl.static_range(1, 4):
        word = word | (tl.load(row_ptr + 4 * offs_k + b).to(tl.int32) << (8 * b))
    return word


@triton.jit
def _unpack_row(row_ptr, dst, x_ptr, ids_ptr, w_ptr, top_k, x_bytes, BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    """The packed row at row_ptr -> row dst of recv_x (x_ptr: its bytes, [R_max, x_bytes]), recv_ids, recv_w."""
    for b0 in range(0, x_bytes, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        tl.store(x_ptr + dst * x_bytes + offs_b, tl.load(row_ptr + offs_b, mask=offs_b < x_bytes), mask=offs_b < x_bytes)
    offs_k = tl.arange(0, BLOCK_K)
    inside = offs_k < top_k
    choice = tl.where(inside, offs_k, 0)
    tl.store(ids_ptr + dst * top_k + offs_k, _word(row_ptr + x_bytes, choice).to(tl.int64), mask=inside)
    weights = _word(row_ptr + x_bytes + 4 * top_k, choice).to(tl.float32, bitcast=True)
    tl.store(w_ptr + dst * top_k + offs_k, weights, mask=inside)


@triton.jit
def _unpack_kernel(recv_ptr, counts_ptr, x_ptr, ids_ptr, w_ptr, ep, block_rows, top_k, x_bytes, row_bytes,
                   BLOCKS: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    """Blocks: program (s, j) moves source s's row j, if it carries a token, to the head; counted: program i
    unpacks row i in place."""
    if BLOCKS:
        src, dst, live = _block_row(counts_ptr, ep, block_rows, BLOCK_EP)
        if live:
            _unpack_row(recv_ptr + src * row_bytes, dst, x_ptr, ids_ptr, w_ptr, top_k, x_bytes, BLOCK_K, BLOCK_B)
    else:
        row = tl.program_id(0).to(tl.int64)
        _unpack_row(recv_ptr + row * row_bytes, row, x_ptr, ids_ptr, w_ptr, top_k, x_bytes, BLOCK_K, BLOCK_B)


@triton.jit
def _expand_kernel(partial_ptr, counts_ptr, blocks_ptr, ep, block_rows, dim, stride_p, stride_b,
                   BLOCK_EP: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Program (s, j): head row start_s + j of the partial sums -> row s * B + j of the blocks (j < counts[s])."""
    block, head, live = _block_row(counts_ptr, ep, block_rows, BLOCK_EP)
    if live:
        for d0 in range(0, dim, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            v = tl.load(partial_ptr + head * stride_p + offs, mask=offs < dim)
            tl.store(blocks_ptr + block * stride_b + offs, v, mask=offs < dim)


@triton.jit
def _sum_kernel(back_ptr, send_rows_ptr, out_ptr, top_k, dim, stride_b, stride_o, BLOCK_D: tl.constexpr):
    """Program (t, c): out[t, cols c] = sum over token t's choices k of back[send_rows[t * K + k], cols c]."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(top_k):
        row = tl.load(send_rows_ptr + t * top_k + k)
        if row >= 0:
            acc += tl.load(back_ptr + row * stride_b + offs, mask=offs < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < dim)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 2))


def route(ids: torch.Tensor, valid: torch.Tensor, num_experts: int, ep: int, block_rows: int,
          send_counts: torch.Tensor, send_rows: torch.Tensor, routed: torch.Tensor) -> None:  # fmt: skip
    """ids [T, K] global expert ids, valid [1] int (device) -> send_counts [ep], send_rows [T * K] and routed [E]
    (int64, contiguous, written): `block_rows` B > 0 places rank d's rows at d * B, 0 packs them."""
    num_tokens, top_k = ids.shape
    _route_kernel[(1,)](
        ids.contiguous(), valid, send_counts, send_rows, routed, num_tokens, top_k, ep, num_experts,
        num_experts // ep, block_rows, BLOCKS=block_rows > 0, **route_tiles(top_k, ep, num_experts),
    )  # fmt: skip


def route_tiles(top_k: int, ep: int, num_experts: int) -> dict[str, int]:
    """`_route_kernel`'s tiles: tokens per step (a [T, K, max(K, ep)] tile of `_TILE` elements), the K choices,
    the ep ranks, pairs per histogram step, and the histogram's bins (E, a power of 2)."""
    block_k, block_ep = _pow2(top_k), _pow2(ep)
    return dict(BLOCK_T=max(1, _TILE // (block_k * max(block_k, block_ep))), BLOCK_K=block_k, BLOCK_EP=block_ep,
                BLOCK_P=_HISTOGRAM_PAIRS, BLOCK_E=_pow2(num_experts))  # fmt: skip


def pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, send_rows: torch.Tensor, send: torch.Tensor):
    """x [T, D], ids [T, K], weights [T, K] -> their packed rows at send_rows [T * K] (those >= 0) of send
    [S, packed_row_bytes] uint8."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return
    x_bytes = x.shape[1] * x.element_size()
    _pack_kernel[(num_tokens,)](
        x.contiguous().view(torch.uint8), ids.contiguous(), weights.contiguous(), send_rows, send, top_k, x_bytes,
        send.shape[1], BLOCK_K=_pow2(top_k), BLOCK_B=min(_BLOCK_BYTES, _pow2(x_bytes)), BLOCK_M=_pow2(8 * top_k),
    )  # fmt: skip


def unpack(received: torch.Tensor, recv_x: torch.Tensor, recv_ids: torch.Tensor, recv_w: torch.Tensor,
           recv_counts: torch.Tensor, block_rows: int) -> None:  # fmt: skip
    """Received packed rows [N, W] uint8 -> the head of recv_x [R_max, D], recv_ids [R_max, K] int64, recv_w
    [R_max, K] fp32: blocks of `block_rows` rows per source compacted by recv_counts (device), or (0) the N
    counted rows as they are."""
    ep, top_k = recv_counts.shape[0], recv_ids.shape[1]
    x_bytes = recv_x.shape[1] * recv_x.element_size()
    if received.shape[0] == 0:
        return
    grid = (ep, block_rows) if block_rows else (received.shape[0],)
    _unpack_kernel[grid](
        received, recv_counts, recv_x.view(torch.uint8), recv_ids, recv_w, ep, block_rows, top_k, x_bytes,
        received.shape[1], BLOCKS=block_rows > 0, BLOCK_EP=_pow2(ep), BLOCK_K=_pow2(top_k),
        BLOCK_B=min(_BLOCK_BYTES, _pow2(x_bytes)),
    )  # fmt: skip


def expand(partial: torch.Tensor, recv_counts: torch.Tensor, block_rows: int, blocks: torch.Tensor) -> None:
    """The head rows of partial [R_max, D] -> blocks [ep * B, D]: source s's rows at s * B.. (the rest unwritten)."""
    ep, dim = recv_counts.shape[0], partial.shape[1]
    _expand_kernel[(ep, block_rows)](
        partial, recv_counts, blocks, ep, block_rows, dim, partial.stride(0), blocks.stride(0),
        BLOCK_EP=_pow2(ep), BLOCK_D=min(_BLOCK_BYTES, _pow2(dim)),
    )  # fmt: skip


def sum_returned(back: torch.Tensor, send_rows: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, D] = per token, the sum of the returned rows back [S, D] at its send_rows [T * K] (fp32)."""
    num_tokens, dim = out.shape
    if num_tokens == 0:
        return
    _sum_kernel[(num_tokens, triton.cdiv(dim, _BLOCK_D))](
        back, send_rows, out, send_rows.shape[0] // num_tokens, dim, back.stride(0), out.stride(0), BLOCK_D=_BLOCK_D,
    )  # fmt: skip

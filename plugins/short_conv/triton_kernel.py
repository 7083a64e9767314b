"""Triton short conv: one program per (channel tile, sequence), token tiles of BT, taps unrolled.

Tap j of token t (position p = t - bos - (W-1) + j in its sequence) loads x[bos + p] when p >= 0 and the
carried window state[slot, :, W-1+p] otherwise (two masked loads), so varlen and decode need no padding.
The window pool is reached through the pool table (`plugins/pool_table.py`: on TensorRT the pool is no network
input) and updated in place: the final window (last W-1 inputs) is loaded as one [BC, W-1] tile, then after a
barrier stored to the slot; each (slot, channel tile) belongs to one program and all its state reads precede
its writes.

Kernel argument order is input pointers, then output pointers, then compile-time constants, as the
TensorRT AOT plugin (``tensorrt_plugin``) requires. Tested on CPU tensors with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..aot_contract import aot_compile_options
from ..pool_table import check_pool_offsets, device_pool_table, in_pool, pool_entry, pool_table
from .inputs import check_inputs
from .sizes import block_sizes


@triton.jit
def short_conv_kernel(
    x_ptr,
    w_ptr,
    pool_table_ptr,
    cu_seqlens_ptr,
    slot_ids_ptr,
    pool_index,
    num_tokens,
    y_ptr,
    C: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BW: tl.constexpr,
):
    """x, y [T, C]; w [C, W] fp32; the window pool [S, C, W-1] fp32 is row `pool_index` of the pool table (S its
    capacity), updated in place; cu_seqlens [N+1]; slot_ids [N]. Sequence bounds are clamped to [0, T] and slots
    to [0, S-1], and an invalid table row touches no pool memory (TensorRT times tactics on unspecified input
    contents)."""
    i_c = tl.program_id(0)
    i_n = tl.program_id(1)
    state_ptr, num_slots, valid = pool_entry(pool_table_ptr, pool_index, tl.float32)
    T = num_tokens.to(tl.int64)
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n).to(tl.int64), 0), T)
    length = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64), bos), T) - bos
    slot = tl.minimum(tl.maximum(tl.load(slot_ids_ptr + i_n).to(tl.int64), 0), num_slots - 1)
    offs_c = i_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    state_row = (slot * C + offs_c) * (W - 1)  # [BC]
    for t0 in range(0, length, BT):
        offs_t = t0 + tl.arange(0, BT)
        mask_t = offs_t < length
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            p = offs_t - (W - 1) + j  # [BT]
            m_x = (mask_t & (p >= 0))[:, None] & mask_c[None, :]
            m_s = in_pool((mask_t & (p < 0))[:, None] & mask_c[None, :], valid)
            b_x = tl.load(x_ptr + (bos + p)[:, None] * C + offs_c[None, :], mask=m_x, other=0.0).to(tl.float32)
            b_s = tl.load(state_ptr + state_row[None, :] + (W - 1 + p)[:, None], mask=m_s, other=0.0)
            w_j = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0)
            acc += (b_x + b_s.to(tl.float32)) * w_j[None, :]
        y = acc * tl.sigmoid(acc)
        m_y = mask_t[:, None] & mask_c[None, :]
        tl.store(y_ptr + (bos + offs_t)[:, None] * C + offs_c[None, :], y.to(y_ptr.dtype.element_ty), mask=m_y)
    offs_w = tl.arange(0, BW)
    p = length - (W - 1) + offs_w  # [BW]
    m_w = offs_w < W - 1
    m_x = mask_c[:, None] & (m_w & (p >= 0))[None, :]
    m_s = in_pool(mask_c[:, None] & (m_w & (p < 0))[None, :], valid)
    b_x = tl.load(x_ptr + (bos + p)[None, :] * C + offs_c[:, None], mask=m_x, other=0.0).to(tl.float32)
    b_s = tl.load(state_ptr + state_row[:, None] + (W - 1 + p)[None, :], mask=m_s, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(state_ptr + state_row[:, None] + offs_w[None, :], b_x + b_s, mask=in_pool(mask_c[:, None] & m_w[None, :], valid))


def launch(x, weight, pool_table, pool_index, cu_seqlens, slot_ids, y):
    """Run the kernel on packed contiguous tensors: x, y [T, C]; weight [C, W] fp32; the window pool [S, C, W-1]
    fp32 is row `pool_index` of `pool_table`. Nothing is checked on the host (the TensorRT plugin's path: garbage
    while TensorRT times tactics is handled in the kernel); whoever builds the table checks it (`pool_table`)."""
    C, W = weight.shape
    N = slot_ids.numel()
    if N == 0:
        return
    BT, BC, BW = block_sizes(C, W)
    grid = (triton.cdiv(C, BC), N)
    short_conv_kernel[grid](
        x, weight, pool_table, cu_seqlens, slot_ids, pool_index, x.shape[0], y, C=C, W=W, BT=BT, BC=BC, BW=BW,
        enable_fp_fusion=True,
    )  # fmt: skip


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``reference.short_conv`` (final window [N, C, W-1] fp32)."""
    w, cu = check_inputs(x, weight, initial_state, cu_seqlens)
    B, T, C = x.shape
    W = w.shape[1]
    N = cu.numel() - 1
    if initial_state is None:
        state = torch.zeros(N, C, W - 1, dtype=torch.float32, device=x.device)
    else:
        state = initial_state.float().clone().contiguous()
    y = torch.empty(B * T, C, dtype=x.dtype, device=x.device)
    slots = torch.arange(N, dtype=torch.int64, device=x.device)
    if N:  # W = 1 keeps no window: no pool memory, an all-zero (invalid) table row
        table = device_pool_table([state]) if state.numel() else torch.zeros(1, 3, dtype=torch.int64, device=x.device)
        launch(x.reshape(B * T, C).contiguous(), w.contiguous(), table, 0, cu, slots, y)
    return y.reshape(B, T, C), state if output_final_state else None


def short_conv_pool(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """ONNX-node semantics (``ShortConv``) with the pool updated in place through a pool table of that one pool:
    x [T, C]; weight [C, W] fp32; conv_pool [S, C, W-1] fp32; cu_seqlens [N+1] int64; slot_ids [N] int64
    (distinct). Returns y [T, C]; slots ``slot_ids`` of ``conv_pool`` are advanced. The table and the slot ids
    are checked before anything is launched (`pool_table.PoolTableError`)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    table = pool_table([conv_pool])
    check_pool_offsets(table, 0, slot_ids=slot_ids.cpu().numpy())
    launch(x.contiguous(), weight.float().contiguous(), torch.from_numpy(table).to(x.device), 0, cu_seqlens, slot_ids, y)
    return y


def aot_compile(act_dtype: str, C: int, W: int, capability: int):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU).

    act_dtype: Triton type of x, y ("fp32", "fp16" or "bf16"); the window pool is fp32.
    Returns Triton's CompiledKernel. Parameters: the 5 input pointers (x, weight, pool table, cu_seqlens,
    slot_ids), int32 pool_index and num_tokens (T), the y pointer; launch grid (cdiv(C, BC), N) with
    ``BC = block_sizes(C, W)[1]``.
    """
    from triton.backends.compiler import GPUTarget

    BT, BC, BW = block_sizes(C, W)
    signature = dict(
        x_ptr=f"*{act_dtype}", w_ptr="*fp32", pool_table_ptr="*i64", cu_seqlens_ptr="*i64", slot_ids_ptr="*i64",
        pool_index="i32", num_tokens="i32", y_ptr=f"*{act_dtype}",
    )  # fmt: skip
    constexprs = dict(C=C, W=W, BT=BT, BC=BC, BW=BW)
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=short_conv_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=aot_compile_options(enable_fp_fusion=True))  # PTX TensorRT's driver loads

"""Triton gated delta scan: recurrent over tokens, one program per (V tile, head, sequence).

Each program keeps its [K, BV] fp32 state tile in registers and walks the tokens of its sequence
(``cu_seqlens``), so varlen batches and decode (one token per sequence) need no padding. The state is
read from and written to a slot pool through ``slot_ids``; ``STATE_V_FIRST`` selects the pool layout:
[S, H, V, K] (K3's V-first cache, used by the ONNX node / TensorRT plugin) or [S, H, K, V] (fla layout).
The pool is reached through the pool table (`plugins/pool_table.py`: on TensorRT it is no network input) and
updated in place: every program reads its tile before writing it.

Kernel argument order is input pointers, the int32 scalars (token count T, pool slot count S), then output
pointers, then compile-time constants, as the TensorRT AOT plugin (``tensorrt_plugin``) requires. Sequence
bounds and slot ids are clamped to [0, T] and [0, S-1]: TensorRT runs plugins while timing tactics with
unspecified input contents, which must not make the kernel read or write outside its buffers.
Tested on CPU tensors with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..aot_contract import aot_compile_options
from ..pool_table import check_pool_offsets, device_pool_table, in_pool, pool_entry, pool_table

from .inputs import L2NORM_EPS, check_inputs
from .sizes import block_sizes

_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def gated_delta_scan_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    pool_table_ptr,
    cu_seqlens_ptr,
    slot_ids_ptr,
    pool_index,
    num_tokens,
    o_ptr,
    scale: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    """q, k, g [T, H, K]; v, o [T, H, V]; beta [T, H]; cu_seqlens [N+1]; slot_ids [N]; the state pool fp32
    [S, ...] is row `pool_index` of the pool table (S its capacity), updated in place; an invalid table row
    touches no pool memory (TensorRT times tactics on garbage)."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    state_ptr, num_slots, valid = pool_entry(pool_table_ptr, pool_index, tl.float32)
    T = num_tokens.to(tl.int64)
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n).to(tl.int64), 0), T)
    eos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64), bos), T)
    slot = tl.minimum(tl.maximum(tl.load(slot_ids_ptr + i_n).to(tl.int64), 0), num_slots - 1)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = in_pool(mask_k[:, None] & mask_v[None, :], valid)
    if STATE_V_FIRST:
        s_off = ((slot * H + i_h) * V + offs_v[None, :]) * K + offs_k[:, None]
    else:
        s_off = ((slot * H + i_h) * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(state_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)  # [BK, BV] = S[k, v]
    for t in range(bos, eos):
        row = t * H + i_h
        b_q = tl.load(q_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta_ptr + row).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + _EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + _EPS)
        S = S * tl.exp(b_g)[:, None]
        u = b_v - tl.sum(S * b_k[:, None], axis=0)
        S = S + b_k[:, None] * (b_beta * u)[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], axis=0)
        tl.store(o_ptr + row * V + offs_v, b_o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_ptr + s_off, S, mask=mask_s)


def launch(q, k, v, g, beta, pool_table, pool_index, cu_seqlens, slot_ids, o, scale, use_qk_l2norm, state_v_first):
    """Run the kernel on packed tensors (q, k, g [T, H, K]; v, o [T, H, V]; beta [T, H]; all contiguous); the
    state pool is row `pool_index` of `pool_table`. Nothing is checked on the host (the TensorRT plugin's path);
    whoever builds the table checks it (`pool_table`)."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = slot_ids.numel()
    if N == 0:
        return
    BK, BV = block_sizes(K, V)
    grid = (triton.cdiv(V, BV), H, N)
    gated_delta_scan_kernel[grid](
        q, k, v, g, beta, pool_table, cu_seqlens, slot_ids, pool_index, T, o,
        scale=float(scale), H=H, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=bool(use_qk_l2norm), STATE_V_FIRST=bool(state_v_first), enable_fp_fusion=True,
    )  # fmt: skip


def gated_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``reference.gated_delta_scan`` (state [N, H, K, V] fp32, K-first)."""
    cu = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = cu.numel() - 1
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta))
    g, beta = g.float(), beta.float()
    if initial_state is None:
        state = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.float().clone().contiguous()
    o = torch.empty(B * T, H, V, dtype=v.dtype, device=q.device)
    slots = torch.arange(N, dtype=torch.int64, device=q.device)
    if N:
        launch(q, k, v, g, beta, device_pool_table([state]), 0, cu, slots, o, scale, use_qk_l2norm_in_kernel, False)
    return o.reshape(B, T, H, V), state if output_final_state else None


def gated_delta_scan_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """ONNX-node semantics (``GatedDeltaScan``) with the pool updated in place through a pool table of that one
    pool: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state_pool [S, H, V, K] fp32 (V-first); cu_seqlens [N+1]
    int64; slot_ids [N] int64 (distinct). Returns o [T, H, V]; slots ``slot_ids`` of ``state_pool`` are advanced.
    The table and the slot ids are checked before anything is launched (`pool_table.PoolTableError`)."""
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    table = pool_table([state_pool])
    check_pool_offsets(table, 0, slot_ids=slot_ids.cpu().numpy())
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g.float(), beta.float()))
    launch(q, k, v, g, beta, torch.from_numpy(table).to(v.device), 0, cu_seqlens, slot_ids, o, scale, use_qk_l2norm,
           True)  # fmt: skip
    return o


def aot_compile(
    act_dtype: str, H: int, K: int, V: int, scale: float, use_qk_l2norm: bool, state_v_first: bool, capability: int
):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU).

    act_dtype: Triton type of q, k, v, o ("fp32", "fp16" or "bf16"); g, beta and states are fp32.
    Returns Triton's CompiledKernel: ``asm["ptx"]``, ``metadata.name``, ``metadata.num_warps``,
    ``metadata.shared``. Parameters: the 8 input pointers (q, k, v, g, beta, pool table, cu_seqlens, slot_ids),
    int32 pool_index and num_tokens (T), the o pointer. Launch grid: (cdiv(V, BV), H, N) with ``BV = block_sizes(K, V)[1]``.
    """
    from triton.backends.compiler import GPUTarget

    BK, BV = block_sizes(K, V)
    act = f"*{act_dtype}"
    signature = dict(
        q_ptr=act, k_ptr=act, v_ptr=act, g_ptr="*fp32", beta_ptr="*fp32", pool_table_ptr="*i64",
        cu_seqlens_ptr="*i64", slot_ids_ptr="*i64", pool_index="i32", num_tokens="i32", o_ptr=act,
    )  # fmt: skip
    constexprs = dict(
        scale=float(scale), H=H, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=bool(use_qk_l2norm), STATE_V_FIRST=bool(state_v_first),
    )  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=gated_delta_scan_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=aot_compile_options(enable_fp_fusion=True))  # PTX TensorRT's driver loads

"""Triton gated delta scan: recurrent over tokens, one program per (V tile, head, sequence).

Each program keeps its [K, BV] fp32 state tile in registers and walks the tokens of its sequence
(``cu_seqlens``), so varlen batches and decode (one token per sequence) need no padding. The state is
read from and written to a slot pool through ``slot_ids``; ``STATE_V_FIRST`` selects the pool layout:
[S, H, V, K] (K3's V-first cache, used by the ONNX node / TensorRT plugin) or [S, H, K, V] (fla layout).
State in and state out may be the same buffer (in-place): every program reads its tile before writing it.

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

from .common import L2NORM_EPS, check_inputs

_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def gated_delta_scan_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_in_ptr,
    cu_seqlens_ptr,
    slot_ids_ptr,
    num_tokens,
    num_slots,
    o_ptr,
    state_out_ptr,
    scale: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    """q, k, g [T, H, K]; v, o [T, H, V]; beta [T, H]; cu_seqlens [N+1]; slot_ids [N]; states fp32 [S, ...]."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2)
    T = num_tokens.to(tl.int64)
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n).to(tl.int64), 0), T)
    eos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64), bos), T)
    slot = tl.minimum(tl.maximum(tl.load(slot_ids_ptr + i_n).to(tl.int64), 0), num_slots.to(tl.int64) - 1)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    if STATE_V_FIRST:
        s_off = ((slot * H + i_h) * V + offs_v[None, :]) * K + offs_k[:, None]
    else:
        s_off = ((slot * H + i_h) * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(state_in_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)  # [BK, BV] = S[k, v]
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
    tl.store(state_out_ptr + s_off, S, mask=mask_s)


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """(BK, BV): the whole key dimension per program, value tiles of at most 32 columns."""
    return triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))


def launch(q, k, v, g, beta, state_in, cu_seqlens, slot_ids, o, state_out, scale, use_qk_l2norm, state_v_first):
    """Run the kernel on packed tensors (q, k, g [T, H, K]; v, o [T, H, V]; beta [T, H]; all contiguous)."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = slot_ids.numel()
    if N == 0 or state_in.shape[0] == 0:
        return
    BK, BV = block_sizes(K, V)
    grid = (triton.cdiv(V, BV), H, N)
    gated_delta_scan_kernel[grid](
        q, k, v, g, beta, state_in, cu_seqlens, slot_ids, T, state_in.shape[0], o, state_out,
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
        state_in = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    else:
        state_in = initial_state.float().contiguous()
    state_out = torch.empty_like(state_in)
    o = torch.empty(B * T, H, V, dtype=v.dtype, device=q.device)
    slots = torch.arange(N, dtype=torch.int64, device=q.device)
    launch(q, k, v, g, beta, state_in, cu, slots, o, state_out, scale, use_qk_l2norm_in_kernel, False)
    return o.reshape(B, T, H, V), state_out if output_final_state else None


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
    state_pool_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ONNX-node semantics (``GatedDeltaScan``): q, k, g [T, H, K]; v [T, H, V]; beta [T, H];
    state_pool [S, H, V, K] fp32 (V-first); cu_seqlens [N+1] int64; slot_ids [N] int64 (distinct).

    Returns o [T, H, V] and the pool with slots ``slot_ids`` advanced (a copy unless
    ``state_pool_out`` is given; passing ``state_pool`` itself updates it in place).
    """
    if state_pool_out is None:
        state_pool_out = state_pool.clone()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g.float(), beta.float()))
    launch(q, k, v, g, beta, state_pool, cu_seqlens, slot_ids, o, state_pool_out, scale, use_qk_l2norm, True)
    return o, state_pool_out


def aot_compile(
    act_dtype: str, H: int, K: int, V: int, scale: float, use_qk_l2norm: bool, state_v_first: bool, capability: int
):
    """Compile the kernel ahead of time for CUDA ``sm_<capability>`` (needs no GPU).

    act_dtype: Triton type of q, k, v, o ("fp32", "fp16" or "bf16"); g, beta and states are fp32.
    Returns Triton's CompiledKernel: ``asm["ptx"]``, ``metadata.name``, ``metadata.num_warps``,
    ``metadata.shared``. Parameters: the 8 input pointers, int32 num_tokens (T) and num_slots (S), the 2 output
    pointers. Launch grid: (cdiv(V, BV), H, N) with ``BV = block_sizes(K, V)[1]``.
    """
    from triton.backends.compiler import GPUTarget

    BK, BV = block_sizes(K, V)
    act = f"*{act_dtype}"
    signature = dict(
        q_ptr=act, k_ptr=act, v_ptr=act, g_ptr="*fp32", beta_ptr="*fp32", state_in_ptr="*fp32",
        cu_seqlens_ptr="*i64", slot_ids_ptr="*i64", num_tokens="i32", num_slots="i32", o_ptr=act,
        state_out_ptr="*fp32",
    )  # fmt: skip
    constexprs = dict(
        scale=float(scale), H=H, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=bool(use_qk_l2norm), STATE_V_FIRST=bool(state_v_first),
    )  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    src = triton.compiler.ASTSource(fn=gated_delta_scan_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(enable_fp_fusion=True))

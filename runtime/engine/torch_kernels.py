"""The torch runner's per-device kernel table: the plugins' ops on the runner's pools, updated in place.

One interface, two implementations, picked by the device (`kernels_for`):
  - `CPUKernels`: the plugins' fast CPU kernels (`plugins/*/cpu.py`); a recurrent op gathers the step's slots,
    runs, and scatters the new state back (O(tokens)); the paged-cache write is `paged_cache_write_`;
  - `CUDAKernels`: the plugins' Triton kernels, launched on the runner's pools through one device pool table
    (`plugins/pool_table.py`) built once at load (the pools never move), with no host synchronisation, so a
    decode step can be captured in a CUDA graph; KDA through fla's kernels where fla runs (CUDA), as the TensorRT
    plugin does (`gated_delta_scan.fla_path`); the MoE on bf16 activations and the experts in the W4A16 kernel's
    layout (`plugins/moe_mxfp4/layout.py`).
Each table names the MXFP4 layout its `moe` reads (`expert_layout`); the runner puts the experts in it at load.

Pools (per rank, as the ONNX Runtime runner lays them out): `kda_state.i` [S, H, V, K] fp32 (V-first),
`conv_state.i` [S, 3P, W-1] fp32, `mla_cache.i` / `index_cache.i` [NB, BS, D] in the cache storage dtype
(fp8: uint8 [NB, BS, D + 1]). Shapes below: T packed tokens, N sequences.
"""

from __future__ import annotations

import torch

from moe_export.plugins.dsa_indexer.cpu import dsa_indexer_cpu
from moe_export.plugins.gated_delta_scan.cpu import gated_delta_scan
from moe_export.plugins.gated_delta_scan.fla_path import fla_kernels, kda_pool_fla
from moe_export.plugins.moe_mxfp4 import layout as mxfp4_layout
from moe_export.plugins.moe_mxfp4.cpu import moe_mxfp4_cpu
from moe_export.plugins.paged_cache_write.cpu import paged_cache_write_
from moe_export.plugins.short_conv.cpu import short_conv
from moe_export.plugins.sparse_mla_attention.cpu import sparse_mla_attention_cpu


class CPUKernels:
    """The plugins' CPU kernels over the pools (fp32 arithmetic)."""

    expert_layout = mxfp4_layout.STANDARD  # the MXFP4 experts' bytes `moe` reads (`RankModel.use_expert_layout`)

    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, cu: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU of x [T, C] with weight [C, W] fp32, continuing the windows of `slots`
        in pool [S, C, W-1]; returns y [T, C] (x's dtype) and advances the slots."""
        y, final = short_conv(x[None], weight, pool[slots], True, cu)
        pool[slots] = final
        return y[0]

    def gated_delta_scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, pool: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """KDA scan (q, k l2-normed in the op): q, k, g [T, H, K], v [T, H, V], beta [T, H] -> o [T, H, V];
        continues the V-first states of `slots` in pool [S, H, V, K]."""
        o, final = gated_delta_scan(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                    initial_state=pool[slots].transpose(-1, -2), output_final_state=True,
                                    cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        pool[slots] = final.transpose(-1, -2)
        return o[0]

    def cache_write(self, pool: torch.Tensor, rows: torch.Tensor, cu: torch.Tensor, tables: torch.Tensor,
                    positions: torch.Tensor) -> None:
        """Store rows [T, D] fp32 (already rounded to the pool's dtype) at each token's block-table row."""
        paged_cache_write_(pool, rows, cu, tables, positions)

    def sparse_mla(self, q: torch.Tensor, pool: torch.Tensor, new: torch.Tensor, cu: torch.Tensor,
                   tables: torch.Tensor, positions: torch.Tensor, indices: torch.Tensor | None, *, scale: float,
                   kv_lora_rank: int) -> torch.Tensor:
        """Absorbed MLA over the paged latents: q [T, H, Dc+Dr] -> o_lat [T, H, Dc] fp32 (indices None: dense)."""
        return sparse_mla_attention_cpu(q, pool, new, cu, tables, positions, indices, scale=scale,
                                        kv_lora_rank=kv_lora_rank)

    def dsa_indexer(self, q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, new: torch.Tensor,
                    cu: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, *, topk: int) -> torch.Tensor:
        """DSA top-k: q [T, Hi, Di], weights [T, Hi] -> indices [T, topk] int64 (-1 padded)."""
        return dsa_indexer_cpu(q, weights, pool, new, cu, tables, positions, topk=topk)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: tuple, **attrs) -> torch.Tensor:
        """This rank's MXFP4 experts on x [T, D] with global ids / routing weights [T, k] -> [T, D] fp32."""
        return moe_mxfp4_cpu(x, ids, weights, *experts, **attrs)


class CUDAKernels:
    """The plugins' Triton kernels over the pools, reached through one device pool table (`pools`: every pool of
    the rank, in a fixed order; a pool's row is looked up by its address)."""

    expert_layout = mxfp4_layout.KERNEL  # the W4A16 kernel's (`layout.kernel_experts`), made once at load

    def __init__(self, pools: list[torch.Tensor]) -> None:
        from moe_export.plugins.pool_table import device_pool_table

        self.table = device_pool_table(pools)
        self.row = {p.data_ptr(): i for i, p in enumerate(pools)}
        self.fla = fla_kernels() if pools and pools[0].is_cuda else None  # (chunk_kda, fused_recurrent_kda_fwd)

    def short_conv(self, x, weight, pool, cu, slots):
        from moe_export.plugins.short_conv.triton_kernel import launch

        y = torch.empty_like(x)
        launch(x.contiguous(), weight, self.table, self.row[pool.data_ptr()], cu, slots, y)
        return y

    def gated_delta_scan(self, q, k, v, g, beta, pool, cu, slots, scale):
        """fla's KDA on the pool where fla runs (`fla_path.kda_pool_fla`, the TensorRT plugin's path: `chunk_kda`
        for prefill, the fused recurrent kernel in place at the slots for decode), else our Triton kernel."""
        if self.fla is not None:
            return kda_pool_fla(q, k, v, g, beta, pool, cu, slots, scale, True, kernels=self.fla)
        from moe_export.plugins.gated_delta_scan.triton_kernel import launch

        o = torch.empty_like(v)
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g.float(), beta.float()))
        launch(q, k, v, g, beta, self.table, self.row[pool.data_ptr()], cu, slots, o, scale, True, True)
        return o

    def cache_write(self, pool, rows, cu, tables, positions):
        from moe_export.plugins.paged_cache_write.triton_kernel import paged_cache_write_launch

        out = torch.empty_like(rows)
        paged_cache_write_launch(self.table, self.row[pool.data_ptr()], pool.shape[1], pool.dtype, rows, cu, tables,
                                 positions, out)

    def sparse_mla(self, q, pool, new, cu, tables, positions, indices, *, scale, kv_lora_rank):
        from moe_export.plugins.sparse_mla_attention.triton_kernel import sparse_mla_attention_launch

        out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float32, device=q.device)
        idx = None if indices is None or indices.shape[1] == 0 else indices.contiguous()
        sparse_mla_attention_launch(q.float().contiguous(), self.table, self.row[pool.data_ptr()], pool.shape[1], pool.dtype,
                                    new.float().contiguous(), cu, tables.contiguous(), positions, idx, out,
                                    scale=scale, kv_lora_rank=kv_lora_rank)
        return out

    def dsa_indexer(self, q, weights, pool, new, cu, tables, positions, *, topk):
        from moe_export.plugins.dsa_indexer.triton_kernel import dsa_indexer_launch

        return dsa_indexer_launch(q, weights, self.table, self.row[pool.data_ptr()], pool.shape[1], pool.dtype, new,
                                  cu, tables, positions, topk=topk)

    def moe(self, x, ids, weights, experts, **attrs):
        """The W4A16 kernel on x in bf16 (its only input: the GPU runner's activations are bf16 already) and the
        experts in its layout -> [T, D] bf16."""
        from moe_export.plugins.moe_mxfp4.triton_kernel import moe_mxfp4_triton

        return moe_mxfp4_triton(x.to(torch.bfloat16), ids, weights, *experts, **attrs)


def kernels_for(device: torch.device, pools: list[torch.Tensor]) -> CPUKernels | CUDAKernels:
    """The kernel table of `device` over a rank's pools."""
    return CUDAKernels(pools) if device.type == "cuda" else CPUKernels()

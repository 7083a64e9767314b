"""GatedDeltaScan (KDA) on our state pool through fla's kernels, the KDA authors' library (what vLLM and SGLang
run): fla's chunked WY-form prefill (`chunk_kda`, tensor cores, chunks of 64) and its fused recurrent decode.

Our node's contract (`reference.gated_delta_scan_node`): q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; the state
pool [S, H, V, K] fp32 (V-first), sequence n's state at slot slot_ids[n], updated in place; cu_seqlens [N+1].
Selected by tokens per sequence (every sequence of a step has at least one token, so T == N means one each):
  - decode (T == N): `fused_recurrent_kda_fwd` reads and writes the pool rows in place (`ssm_state_indices` =
    slot ids, `inplace_final_state`, `state_v_first`): no gather, no host synchronization (CUDA graphs hold it);
  - prefill: the slots' states gathered [N, H, V, K], `chunk_kda` over the packed sequences (`cu_seqlens`,
    V-first states), the final states scattered back into the slots (fla computes its chunk indices on the host).
How TensorRT runs it: the GatedDeltaScan plugin's JIT `impl` (a Python callback in the runner's process, on
TensorRT's stream) takes this path when fla imports and the pool table is one the runner made in that process
(`pool_table.pools_of_table` gives the pool tensors); otherwise, and in every AOT engine (one Triton launch that
TensorRT makes itself), our own kernel (`triton_kernel.launch`, token by token) runs.
"""

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def fla_kernels():
    """(chunk_kda, fused_recurrent_kda_fwd) from fla, or None when fla does not import here."""
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # fla missing or broken: our kernel runs instead
        return None
    return chunk_kda, fused_recurrent_kda_fwd


def kda_pool_fla(q, k, v, g, beta, state_pool, cu_seqlens, slot_ids, scale: float, use_qk_l2norm: bool, *,
                 out: torch.Tensor | None = None, kernels=None) -> torch.Tensor:
    """o [T, H, V] in v's dtype (written into `out` when given); `state_pool` rows `slot_ids` advanced in place.
    `kernels`: (chunk, recurrent) with fla's signatures (default `fla_kernels()`)."""
    chunk, recurrent = kernels or fla_kernels()
    args = [x.unsqueeze(0) for x in (q, k, v, g.float(), beta.float())]
    common = dict(scale=float(scale), use_qk_l2norm_in_kernel=bool(use_qk_l2norm), cu_seqlens=cu_seqlens,
                  state_v_first=True)  # fmt: skip
    if q.shape[0] == slot_ids.shape[0]:  # one token per sequence
        o, _ = recurrent(*args, initial_state=state_pool, output_final_state=True, inplace_final_state=True,
                         ssm_state_indices=slot_ids, **common)  # fmt: skip
    else:
        o, final = chunk(*args, initial_state=state_pool[slot_ids], output_final_state=True, **common)
        state_pool.index_copy_(0, slot_ids, final.to(state_pool.dtype))
    if out is None:
        return o[0]
    out.copy_(o[0])
    return out

"""Naive fp32 reference of MoEMXFP4: this rank's routed experts with MXFP4 weights (W4A16).

Inputs (E = E_local experts on this rank, global ids expert_offset .. expert_offset+E-1):
  x [T, D]; expert_ids [T, k] global ids; expert_weights [T, k] routing weights;
  w13_packed [E, 2I, D/2] u8, w13_scale [E, 2I, D/32] u8: rows 0..I-1 gate (w1), rows I..2I-1 up (w3);
  w2_packed [E, D, I/2] u8, w2_scale [E, D, I/32] u8 (down).
  MXFP4 (see `moe_export.quantize.mxfp4`): low nibble = even element, E2M1 values, E8M0 scale 2^(s-127) per
  32 consecutive input-dim elements.
Output y [T, D] fp32 = Σ_j [expert_ids[t,j] on this rank] * expert_weights[t,j] * Expert_e(x[t]), with
  Expert_e(z) = W2_e @ act(W1_e z, W3_e z), e = expert_ids[t,j] - expert_offset; other ranks' experts add 0,
  so summing every rank's y gives the full routed sum (reduce before the latent norm).
  act "situ": beta*tanh(gate/beta)*sigmoid(gate) * lin_beta*tanh(up/lin_beta)  (K3: beta 4, lin_beta 25)
  act "silu": silu(gate) * up
"""

import torch

from moe_export.quantize import mxfp4

from .inputs import ACTIVATIONS, moe_inputs


def gated_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str, beta: float, linear_beta: float
) -> torch.Tensor:
    """Elementwise fp32 gated activation of gate, up [..., I] -> [..., I] ("situ" or "silu")."""
    if activation == "situ":
        return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def moe_mxfp4_reference(
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
) -> torch.Tensor:
    """One (token, choice) pair at a time; weights decoded with `quantize.mxfp4.decode`. -> y [T, D] fp32."""
    num_tokens, top_k, num_local, inter, dim = moe_inputs(x, expert_ids, expert_weights, w13_packed, w13_scale,
                                                          w2_packed, w2_scale, activation)
    y = torch.zeros(num_tokens, dim, dtype=torch.float32, device=x.device)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(expert_ids[t, j]) - expert_offset
            if not 0 <= e < num_local:
                continue
            h = mxfp4.decode(w13_packed[e], w13_scale[e]) @ x[t].float()  # [2I]
            a = gated_activation(h[:inter], h[inter:], activation, situ_beta, situ_linear_beta)
            y[t] += float(expert_weights[t, j]) * (mxfp4.decode(w2_packed[e], w2_scale[e]) @ a)
    return y

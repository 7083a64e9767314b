"""Run with TRITON_INTERPRET=1 on a torch-backend engine (argv[1]): the same prefill + 3 greedy decode steps with the
CPU kernel table and with the CUDA one (`torch_kernels.CUDAKernels`: the plugins' Triton kernels through the pool
table, interpreted on CPU tensors), the engine loading its experts for it (the W4A16 kernel's layout, made once at
load: the bytes equal the CPU engine's standard ones moved once). The MoE is checked call by call (`checked_moe`),
then the CPU kernel's result goes on, so that the bf16 MoE's roundings (within BF16_TOL of its output, not of the
logits) leave the other kernels compared end to end as tightly as before. Prints {"max_err": largest logit difference,
"atol": the float32 reordering bound of those logits (fp32_reorder.reorder_atol), "same_tokens": bool,
"experts_converted_once": bool, "moe_calls": int, "moe_err": largest MoE error relative to max(1, max |y|)}."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from moe_export.plugins.moe_mxfp4.cpu import moe_mxfp4_cpu
from moe_export.plugins.moe_mxfp4.layout import from_kernel_layout, to_kernel_layout
from moe_export.runtime.engine import torch_runner
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.torch_kernels import CUDAKernels

from fp32_reorder import num_layers, reorder_atol

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]


def rank_experts(engine) -> list[tuple[torch.Tensor, ...]]:
    """Every MoE layer's experts (w13_packed, w13_scale, w2_packed, w2_scale) of every rank, in one order."""
    return [layer.ffn.packed for model in engine.models.values() for i, layer in enumerate(model.layers)
            if model.cfg.is_moe(i)]


def checked_moe(moe, errors: list[float]):
    """`CUDAKernels.moe` checked call by call: its result (bf16 x, activations and y; the experts in the kernel's
    layout) against the CPU kernel on the experts read back in the standard layout and the same x rounded to bf16,
    over the valid rows (the head sum(recv_counts) of a receive buffer); the error relative to max(1, max |y|)
    appended to `errors`; the CPU kernel's result on x as it is is returned (rows past the valid ones: the kernel's)."""
    def run(self, x, ids, weights, experts, *, recv_counts=None, row_bound=None, **attrs):
        y = moe(self, x, ids, weights, experts, recv_counts=recv_counts, row_bound=row_bound, **attrs)
        n = x.shape[0] if recv_counts is None else int(recv_counts.sum())
        std = (from_kernel_layout(experts[0]), experts[1], from_kernel_layout(experts[2]), experts[3])
        want = moe_mxfp4_cpu(x[:n].bfloat16().float(), ids[:n], weights[:n], *std, **attrs)
        if n:
            errors.append(float((y[:n].float() - want).abs().max()) / max(1.0, float(want.abs().max())))
        out = y.float()
        out[:n] = moe_mxfp4_cpu(x[:n], ids[:n], weights[:n], *std, **attrs)
        return out
    return run


def main() -> None:
    cpu = torch_runner.TorchEngine(sys.argv[1], num_slots=2, num_blocks=8)
    errors: list[float] = []
    CUDAKernels.moe = checked_moe(CUDAKernels.moe, errors)
    torch_runner.kernels_for = lambda device, pools: CUDAKernels(pools)  # the GPU path's table, on CPU
    triton = torch_runner.TorchEngine(sys.argv[1], num_slots=2, num_blocks=8)
    pairs = list(zip(rank_experts(cpu), rank_experts(triton)))
    converted_once = bool(pairs) and all(torch.equal(kern[0], to_kernel_layout(std[0])) and
                                         torch.equal(kern[2], to_kernel_layout(std[2])) for std, kern in pairs)
    blocks = [5, 2, 7]
    tokens, worst, atol, same = PROMPT, 0.0, 0.0, True
    for start in (0, len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2):
        a, b = (e.step(StepBatch.from_sequences([SequenceChunk(1, start, tokens, blocks)]))[0] for e in (cpu, triton))
        worst, same = max(worst, float(np.abs(a - b).max())), same and int(a.argmax()) == int(b.argmax())
        atol = max(atol, reorder_atol(a, num_layers(cpu.model_config), cpu.max_seq_len))
        tokens = [int(a.argmax())]
    print(json.dumps({"max_err": worst, "atol": atol, "same_tokens": same, "experts_converted_once": converted_once,
                      "moe_calls": len(errors), "moe_err": max(errors, default=float("nan"))}))


if __name__ == "__main__":
    main()

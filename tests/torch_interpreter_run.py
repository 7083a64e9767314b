"""Run with TRITON_INTERPRET=1 on a torch-backend engine (argv[1]): the same prefill + 3 greedy decode steps with the
CPU kernel table and with the CUDA one (`torch_kernels.CUDAKernels`: the plugins' Triton kernels through the pool
table, interpreted on CPU tensors), the engine loading its experts for it (the W4A16 kernel's layout, made once at
load). The MoE is checked call by call: the CUDA table's (bf16 x, bf16 activations and y) against the CPU kernel on
the CPU engine's standard experts and the same x rounded to bf16; then the CPU kernel's result on x as it is goes
on, so that the bf16 MoE's roundings (within BF16_TOL of its output, not of the logits) leave the other kernels
compared end to end as tightly as before. Prints {"max_err": largest logit difference, "same_tokens": bool,
"experts_converted_once": bool, "moe_calls": int, "moe_err": largest MoE error relative to max(1, max |y|)}."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from moe_export.plugins.moe_mxfp4.cpu import moe_mxfp4_cpu
from moe_export.plugins.moe_mxfp4.layout import to_kernel_layout
from moe_export.runtime.engine import torch_runner
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.torch_kernels import CUDAKernels

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]


def rank_experts(engine) -> list[tuple[torch.Tensor, ...]]:
    """Every MoE layer's experts (w13_packed, w13_scale, w2_packed, w2_scale) of every rank, in one order."""
    return [layer.ffn.packed for model in engine.models.values() for i, layer in enumerate(model.layers)
            if model.cfg.is_moe(i)]


class CheckedCUDAKernels(CUDAKernels):
    """The CUDA table, each MoE call's output compared with the CPU kernel on the standard experts (`standard`:
    the kernel-layout w13_packed's address -> the CPU engine's experts of that layer); the CPU kernel's output on
    x as given is returned."""

    standard: dict[int, tuple[torch.Tensor, ...]] = {}
    moe_err: list[float] = []

    def moe(self, x, ids, weights, experts, **attrs):
        y = super().moe(x, ids, weights, experts, **attrs)
        std = self.standard[experts[0].data_ptr()]
        want = moe_mxfp4_cpu(x.bfloat16().float(), ids, weights, *std, **attrs)
        self.moe_err.append(float((y.float() - want).abs().max()) / max(1.0, float(want.abs().max())))
        return moe_mxfp4_cpu(x, ids, weights, *std, **attrs)


def main() -> None:
    cpu = torch_runner.TorchEngine(sys.argv[1], num_slots=2, num_blocks=8)
    torch_runner.kernels_for = lambda device, pools: CheckedCUDAKernels(pools)  # the GPU path's table, on CPU
    triton = torch_runner.TorchEngine(sys.argv[1], num_slots=2, num_blocks=8)
    pairs = list(zip(rank_experts(cpu), rank_experts(triton)))
    CheckedCUDAKernels.standard = {kern[0].data_ptr(): std for std, kern in pairs}
    converted_once = bool(pairs) and all(torch.equal(kern[0], to_kernel_layout(std[0])) and
                                         torch.equal(kern[2], to_kernel_layout(std[2])) for std, kern in pairs)
    blocks = [5, 2, 7]
    tokens, worst, same = PROMPT, 0.0, True
    for start in (0, len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2):
        a, b = (e.step(StepBatch.from_sequences([SequenceChunk(1, start, tokens, blocks)]))[0] for e in (cpu, triton))
        worst, same = max(worst, float(np.abs(a - b).max())), same and int(a.argmax()) == int(b.argmax())
        tokens = [int(a.argmax())]
    errs = CheckedCUDAKernels.moe_err
    print(json.dumps({"max_err": worst, "same_tokens": same, "experts_converted_once": converted_once,
                      "moe_calls": len(errs), "moe_err": max(errs, default=float("nan"))}))


if __name__ == "__main__":
    main()

"""Run with TRITON_INTERPRET=1 on a torch-backend engine (argv[1]): the same prefill + 3 greedy decode steps with the
CPU kernel table and with the CUDA one (`torch_kernels.CUDAKernels`: the plugins' Triton kernels through the pool
table, interpreted on CPU tensors). Prints {"max_err": largest logit difference, "same_tokens": bool}."""

from __future__ import annotations

import json
import sys

import numpy as np

from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.torch_kernels import CUDAKernels
from moe_export.runtime.engine.torch_runner import TorchEngine

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400]


def main() -> None:
    cpu, triton = (TorchEngine(sys.argv[1], num_slots=2, num_blocks=8) for _ in range(2))
    for r, pools in triton.pools.items():
        triton.kernels[r] = CUDAKernels(list(pools.values()))
    blocks = [5, 2, 7]
    tokens, worst, same = PROMPT, 0.0, True
    for start in (0, len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2):
        a, b = (e.step(StepBatch.from_sequences([SequenceChunk(1, start, tokens, blocks)]))[0] for e in (cpu, triton))
        worst, same = max(worst, float(np.abs(a - b).max())), same and int(a.argmax()) == int(b.argmax())
        tokens = [int(a.argmax())]
    print(json.dumps({"max_err": worst, "same_tokens": same}))


if __name__ == "__main__":
    main()

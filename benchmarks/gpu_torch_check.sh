#!/usr/bin/env bash
# The torch backend on a lent H200 (< 13 minutes; time limits sum to 780 s): tiny-k3 and mid-k3 (K3's real widths)
# built with backend torch, greedy tokens against the fp32 reference, `moe-export serve` answering the openai client
# (gpu_torch_check.py), then one K3 rank of h100x64 in the dp layout: decode step at 32 / 256 sequences with 8k
# contexts against its bandwidth bound, CUDA graphs on / off, prefill of one 8k chunk (gpu_rank_step.py).
# Run from the repo root on the device machine, e.g. through the `device` tool:
#   bash benchmarks/gpu_torch_check.sh      (figures printed; also written to $OUT/*.json if OUT is set)
# Wheels missing there (pydantic + pydantic_core cp312 + annotated-types + typing-inspection; for the serve step
# fastapi, starlette, uvicorn, h11, anyio, sniffio, click, openai, httpx, httpcore, jiter cp312, distro) are carried
# in .whl/ and installed with --no-deps into .device-deps/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/.device-src:$PWD/.device-deps:${PYTHONPATH:-}"
mkdir -p .device-src/moe_export
for d in common export graphs quantize plugins runtime recipes; do
  if [ -d "$d" ]; then ln -sfn "$PWD/$d" ".device-src/moe_export/$d"; fi
done
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-deps --target .device-deps .whl/*.whl; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 480 python3 benchmarks/gpu_torch_check.py --json "${OUT:-/tmp}/gpu_torch_check.json" || echo "gpu_torch_check failed"
timeout 300 python3 benchmarks/gpu_rank_step.py --json "${OUT:-/tmp}/gpu_rank_step.json"

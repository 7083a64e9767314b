#!/usr/bin/env bash
# One short GPU run (< 8 minutes) for a lent H200: the TensorRT AOT kernels launched as TensorRT launches them
# (cuda-python; gpu_aot_check.py), then the Triton kernels against fla and bf16 baselines and the no-host-sync /
# CUDA-graph capture of the MoE and indexer plugin bodies (gpu_check.py), then the runner's batched sampler on the
# GPU (gpu_sampler_check.py: batch 1/16/64/256 x vocab 163,840, greedy vs temperature 1 top-p 0.95, seeded rows
# alone vs in a batch). Time limits sum to 460 s.
# Run from the repo root on the device machine, e.g. through the `device` tool:
#   bash benchmarks/gpu_check.sh            (figures printed; also written to $OUT/gpu_check.json if OUT is set)
# The machine needs torch (CUDA), triton and fla; missing pure-Python wheels can be carried in .whl/ and
# installed with --no-deps --target (see the device tool's README).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/.device-src:${PYTHONPATH:-}"
mkdir -p .device-src/moe_export
for d in export graphs quantize plugins runtime recipes; do ln -sfn "$PWD/$d" ".device-src/moe_export/$d"; done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 100 python3 benchmarks/gpu_aot_check.py --json "${OUT:-/tmp}/gpu_aot_check.json" || echo "gpu_aot_check failed"
timeout 300 python3 benchmarks/gpu_check.py --json "${OUT:-/tmp}/gpu_check.json" || echo "gpu_check failed"
timeout 60 python3 benchmarks/gpu_sampler_check.py --json "${OUT:-/tmp}/gpu_sampler_check.json"

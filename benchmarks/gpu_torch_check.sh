#!/usr/bin/env bash
# The torch backend on a lent GPU (gpu_torch_check.py), two device commands of at most 8 minutes each
# (benchmarks/README.md "Device commands"):
#   bash benchmarks/gpu_torch_check.sh tiny-k3   command 2, any lent GPU (< 7 min): tiny-k3 built with backend
#                                                torch, greedy tokens against the fp32 reference, then
#                                                `moe-export serve` answering the openai client;
#                                                $OUT/gpu_torch_tiny_k3.json
#   bash benchmarks/gpu_torch_check.sh mid-k3    command 3, an H200 (`kind: nvidia-h200`: mid-k3's recipe sizes
#                                                its pools for 141 GB) (< 8 min): mid-k3 (K3's real widths) the
#                                                same, then decode steps at 32 sequences x 8k contexts and one 8k
#                                                prefill chunk timed on the runtime's own step path against their
#                                                bandwidth bound; $OUT/gpu_torch_mid_k3.json
# Every stage writes the JSON when it ends (a timeout keeps what was measured). Run from the repo root on the
# device machine with `carry: [".whl"]` (the wheels of benchmarks/device_wheels.txt, fetched here by
# `bash benchmarks/device_wheels.sh`; pydantic, fastapi, uvicorn, openai, xgrammar, jsonschema and their deps).
set -uo pipefail
cd "$(dirname "$0")/.."
preset="${1:-tiny-k3}"
. benchmarks/device_env.sh
case "$preset" in
  tiny-k3) timeout 420 python3 benchmarks/gpu_torch_check.py --preset tiny-k3 --serve \
             --json "$OUT/gpu_torch_tiny_k3.json" || echo "gpu_torch_check tiny-k3 failed" ;;
  mid-k3) timeout 450 python3 benchmarks/gpu_torch_check.py --preset mid-k3 --decode-timing \
            --json "$OUT/gpu_torch_mid_k3.json" || echo "gpu_torch_check mid-k3 failed" ;;
  *) echo "usage: bash benchmarks/gpu_torch_check.sh tiny-k3|mid-k3" >&2; exit 2 ;;
esac

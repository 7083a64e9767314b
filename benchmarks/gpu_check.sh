#!/usr/bin/env bash
# One short GPU run (< 8 minutes) for a lent H200: the TensorRT AOT kernels launched as TensorRT launches them
# (cuda-python; gpu_aot_check.py: `*_aot_vs_jit`), then the Triton kernels against the measured read bandwidth and
# bf16 matmul rate, fla and the bf16 / torch baselines, each checked for correctness at its shape (gpu_check.py:
# kda_*_vs_fla, moe_*_frac, sparse_mla_*, indexer_*), then the runner's batched sampler on the GPU
# (gpu_sampler_check.py: sampler_ms_top_p_256, sampler_top_p_over_greedy_256, ...), then the dp-layout MoE op on the
# full receive buffer and on the counted rows at K3's shapes (gpu_trt_check.py: dp_moe_counted_speedup), then the
# dp decode step's MoE layer without a host sync and as a CUDA graph (gpu_dp_step_check.py: dp_layer_*). Time limits
# sum to 450 s.
# A failing check records `<check>_error` and the others still run. All figures end up in one flat object,
# $OUT/gpu_check.json (each step's own file beside it).
# Device command 1 of 4 (benchmarks/README.md "Device commands"): at most 8 minutes, any lent GPU.
# Run from the repo root on the device machine, e.g. through the `device` tool with `carry: [".whl"]`:
#   bash benchmarks/gpu_check.sh            (figures printed; written to $OUT/gpu_check.json, OUT defaults to /tmp)
# The wheels it needs beyond the machine's packages (benchmarks/device_wheels.txt: pydantic and its deps, fla) are
# fetched here by `bash benchmarks/device_wheels.sh` and installed there by benchmarks/device_env.sh.
# Rehearsal here (no GPU, only the device's packages importable): tests/test_device_rehearsal.py.
# CPU smoke run (tests/test_gpu_check.py): GPU_CHECK_SMOKE=1 TRITON_INTERPRET=1 python benchmarks/gpu_check.py
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
timeout 50 python3 benchmarks/gpu_aot_check.py --json "$OUT/gpu_aot_check.json" || echo "gpu_aot_check failed"
timeout 240 python3 benchmarks/gpu_check.py --json "$OUT/gpu_kernels_check.json" || echo "gpu_check failed"
timeout 45 python3 benchmarks/gpu_sampler_check.py --json "$OUT/gpu_sampler_check.json" || echo "gpu_sampler_check failed"
timeout 80 python3 benchmarks/gpu_trt_check.py --json "$OUT/gpu_trt_check.json" || echo "gpu_trt_check failed"
timeout 35 python3 benchmarks/gpu_dp_step_check.py --json "$OUT/gpu_dp_step_check.json" || echo "gpu_dp_step_check failed"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
merged = {}
for step in ("gpu_aot_check", "gpu_kernels_check", "gpu_sampler_check", "gpu_trt_check", "gpu_dp_step_check"):
    path = out / f"{step}.json"
    merged.update(json.loads(path.read_text()) if path.exists() else {f"{step}_error": "no output (failed or timed out)"})
(out / "gpu_check.json").write_text(json.dumps(merged, indent=2, sort_keys=True))
print(json.dumps(merged, sort_keys=True))
PY

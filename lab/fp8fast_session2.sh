#!/usr/bin/env bash
# Second device call of the Gluon FP8 grouped GEMM (the producer transposes before it waits for a free stage):
# the transposition lag probe, the GPU tests, the grouped GEMMs and the frozen-expert MoE (fp8, bf16). In $OUT.
set -u
OUT=${OUT:-/tmp/fp8out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout 60 python3 lab/probes/fp8_gluon_lag.py 2>&1 | tail -8 | tee "$OUT/lag.txt"
grep -q "down_t LAG=3" "$OUT/lag.txt" || { echo "LAG PROBE FAILED"; exit 1; }
timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py -k "gluon or moe" 2>&1 | tail -40 \
  > "$OUT/fp8_gpu_tests.txt"
grep "gluon\|moe fp8\|passed\|failed" "$OUT/fp8_gpu_tests.txt" | tail -16
B="python3 -m benchmarks.run --warmup-ms 10 --rep-ms 60 --commit ${COMMIT:-unknown}"
{
timeout 80 $B --op fp8_grouped --providers fp8,bf16 --mode fwd --shape gemm=gate_up,down,gate_up_t,down_t \
  --json "$OUT/grouped.json"
timeout 50 $B --op moe_frozen --providers fp8,bf16 --mode fwd,fwdbwd --json "$OUT/moe_frozen.json"
} 2>&1 | grep -v "^\s*File\|^Traceback" | tee "$OUT/bench.txt"

#!/usr/bin/env bash
# One device call: where the FP8 input gradient loses (lab/probes/fp8_gluon_xpose.py), the FP8 GPU tests, the
# frozen-expert MoE (fp8, bf16). In $OUT.   COMMIT=<sha> bash lab/xpose_session.sh
set -u
OUT=${OUT:-/tmp/xpose}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 170 python3 -m lab.probes.fp8_gluon_xpose 2>&1 | grep -v Warning | tee "$OUT/xpose.txt" | tail -20
echo "[xpose] $((SECONDS - START)) s"
timeout 60 python3 -m benchmarks.run --warmup-ms 10 --rep-ms 60 --commit "${COMMIT:-unknown}" --op moe_frozen \
  --providers fp8,bf16 --mode fwd,fwdbwd --json "$OUT/moe_frozen.json" 2>&1 | tail -6
echo "[moe] $((SECONDS - START)) s"
timeout 220 python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/ops/test_fp8_gpu.py tests/ops/test_fp8_gluon_build.py \
  tests/models/test_fp8_model_gpu.py tests/integrations/test_integration_hf_fp8.py tests/ops/test_moe_lora.py \
  > "$OUT/tests_fp8.txt" 2>&1
echo "[tests] rc $? $(grep -cE ' PASSED' "$OUT/tests_fp8.txt") passed, $(grep -cE ' FAILED' "$OUT/tests_fp8.txt") failed"
grep -E "FAILED|Error" "$OUT/tests_fp8.txt" | head -10; tail -3 "$OUT/tests_fp8.txt"
echo "[session] $((SECONDS - START)) s"

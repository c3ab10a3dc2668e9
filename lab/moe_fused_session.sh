#!/usr/bin/env bash
# Device call after the transposition layout and the MoE's fused quantization: the FP8 / MoE GPU tests, the grouped
# GEMMs, the frozen-expert MoE (the finetune page's moe part) and its kernels by time. In $OUT.
#   COMMIT=<sha> bash lab/moe_fused_session.sh
set -u
OUT=${OUT:-/tmp/moefused}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
B="python3 -m benchmarks.run --warmup-ms 10 --rep-ms 60 --commit ${COMMIT:-unknown}"
timeout 90 $B --op fp8_grouped --providers fp8,bf16 --mode fwd --shape gemm=gate_up,down,gate_up_t,down_t \
  --json "$OUT/grouped.json" 2>&1 | grep -v Warn | tail -9
echo "[grouped] $((SECONDS - START)) s"
timeout 90 python3 -m benchmarks.finetune --ckpt /tmp/none --json "$OUT/finetune_moe.json" --parts moe \
  --commit "${COMMIT:-unknown}" 2>&1 | grep -v Warn | tail -6
echo "[moe] $((SECONDS - START)) s"
timeout 60 python3 -m lab.probes.moe_profile 2>&1 | grep -v Warn | tee "$OUT/moe_profile.txt" | head -12
echo "[profile] $((SECONDS - START)) s"
timeout 240 python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/ops/test_fp8_gpu.py tests/ops/test_moe_gpu.py \
  tests/ops/test_moe_lora.py tests/models/test_fp8_model_gpu.py tests/integrations/test_integration_hf_fp8.py \
  > "$OUT/tests.txt" 2>&1
echo "[tests] rc $?: $(tail -1 "$OUT/tests.txt")"
grep -E "FAILED|Error" "$OUT/tests.txt" | head -10
echo "[session] $((SECONDS - START)) s"

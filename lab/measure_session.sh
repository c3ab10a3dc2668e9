#!/usr/bin/env bash
# One device call, in order of worth: the frozen MoE and (a) / (d) / (c) at 16k on the slice
# (lab/finetune_moe_session.sh, records in $OUT); the GPU tests that do not depend on SWAP (the FP8 ops, the Gluon
# kernel with LoRA's term, LoRA's Triton kernels, the HF FP8 integration); the MoE with LoRA unfused / fused
# (lab.probes.moe_lora_fused); then, in the time left, where SWAP faults (lab.probes.fp8_swap_fault).
#   LIMIT=<s> COMMIT=<sha> bash lab/measure_session.sh
set -u
OUT=${OUT:-/tmp/measure}; mkdir -p "$OUT"; START=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - (SECONDS - START) - ${1:-0})); }
STEPS_TIMEOUT=$(left 200) CASES="a:16384;d:16384;c:16384" OUT="$OUT" COMMIT="${COMMIT:-unknown}" \
  bash "$(dirname "$0")/finetune_moe_session.sh" 2>&1
. "$(dirname "$0")/device_env.sh" > /dev/null
timeout "$(left 80)" python3 -m pytest -q -s -p no:cacheprovider -k "not swap" tests/ops/test_fp8_gpu.py \
  tests/ops/test_lora_kernels_gpu.py tests/integrations/test_integration_hf_fp8.py > "$OUT/gpu_tests.txt" 2>&1
grep -E "gluon|moe lora|passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -24
echo "[tests] $((SECONDS - START)) s"
WAYS="bf16,fp8,fp8 fused" timeout "$(left 20)" python3 -m lab.probes.moe_lora_fused 2>&1 | tail -12
echo "[lora] $((SECONDS - START)) s"
if [ "$(left)" -gt 40 ]; then
  TRITON_CACHE_DIR=/tmp/swap_cache timeout "$(left)" python3 -m lab.probes.fp8_swap_fault 2>&1 | tail -14
fi
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# Device call: the slice written (release format, drawn on the GPU; kept if there), the MoE's bitwise tests, then
# where (a)'s step goes by kernel at 16k (lab.probes.finetune_step_profile). In $OUT.
#   COMMIT=<sha> bash lab/profile_session.sh
set -u
OUT=${OUT:-/tmp/profile}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 60 python3 -m benchmarks.finetune --ckpt /tmp/csattn_v4_flash_slice --parts write --draw device \
  --json "$OUT/write.json" --commit "${COMMIT:-unknown}" 2>&1 | grep -E "^\[" | tail -2
timeout 70 python3 -m pytest -q -s -rA -p no:cacheprovider -k bitwise tests/ops/test_fp8_gpu.py \
  > "$OUT/bitwise_tests.txt" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/bitwise_tests.txt" | tail -8
echo "[tests] $((SECONDS - START)) s"
timeout 120 python3 -m lab.probes.finetune_step_profile --ckpt /tmp/csattn_v4_flash_slice --modes a \
  > "$OUT/step_profile.txt" 2>&1; head -60 "$OUT/step_profile.txt"
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# One device call, in order of worth: the frozen MoE, then (d) / (a) / (c) at 16k side by side on the slice with the
# library's defaults (LoRA's term in the FP8 kernel since 4294d92; lab/finetune_moe_session.sh, records in $OUT); then
# the MoE's bitwise tests (the reference runs the op's SwiGLU variant with LoRA since 4294d92); then (a)'s step
# profile in the time left.
#   LIMIT=<s> COMMIT=<sha> [CASES="a:16384" on an H100, which cannot hold (c) or (d)] bash lab/measure_session.sh
set -u
OUT=${OUT:-/tmp/measure}; mkdir -p "$OUT"; START=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - (SECONDS - START) - ${1:-0})); }
STEPS_TIMEOUT=$(left 90) CASES="${CASES:-d:16384;a:16384;c:16384}" OUT="$OUT" COMMIT="${COMMIT:-unknown}" \
  bash "$(dirname "$0")/finetune_moe_session.sh" 2>&1
. "$(dirname "$0")/device_env.sh" > /dev/null
timeout "$(left 100)" python3 -m pytest -q -s -rA -p no:cacheprovider -k bitwise tests/ops/test_fp8_gpu.py \
  > "$OUT/bitwise_tests.txt" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/bitwise_tests.txt" | tail -8
echo "[tests] $((SECONDS - START)) s"
# where (a)'s step goes now, by kernel (the last profile, step_profile_f9f0ea2.txt, predates the factored LoRA)
[ "$(left)" -gt 60 ] && timeout "$(left)" python3 -m lab.probes.finetune_step_profile \
  --ckpt /tmp/csattn_v4_flash_slice --modes a > "$OUT/step_profile.txt" 2>&1; head -40 "$OUT/step_profile.txt"
echo "[session] $((SECONDS - START)) s"

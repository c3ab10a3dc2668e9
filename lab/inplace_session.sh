#!/usr/bin/env bash
# Device call (H100 or H200): does the input gradient transposing each weight tile in place (INPLACE, off by default)
# shorten mode (a)'s step? At 506d052 its GEMMs ran faster (gate_up 6.49 -> 6.08 ms, down 3.39 -> 3.21) but the frozen
# MoE did not (19.68-19.90 against 19.72), and its step was never timed. Its GPU tests (with LoRA's term in the
# kernel), the GEMMs and the frozen MoE by form, then (a) at 16k alternating the default and --inplace, twice. In $OUT.
#   COMMIT=<sha> bash lab/inplace_session.sh
set -u
OUT=${OUT:-/tmp/inplace}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -k "inplace" tests/ops/test_fp8_gpu.py > "$OUT/inplace_tests.txt" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/inplace_tests.txt" | tail -6
echo "[tests] $((SECONDS - START)) s"
timeout 100 python3 -m lab.probes.fp8_gluon_inplace > "$OUT/moe_inplace.txt" 2>&1; tail -14 "$OUT/moe_inplace.txt"
echo "[moe] $((SECONDS - START)) s"
timeout 60 python3 -m benchmarks.finetune --ckpt /tmp/csattn_v4_flash_slice --parts write --draw device \
  --json "$OUT/write.json" --commit "${COMMIT:-unknown}" 2>&1 | grep -E "^\[" | tail -2
for round in 1 2; do
  for form in default inplace; do
    flag=$([ "$form" = inplace ] && echo --inplace)
    timeout 110 python3 -m lab.finetune_variant $flag -- --ckpt /tmp/csattn_v4_flash_slice --parts steps --steps 5 \
      --cases a:16384 --json "$OUT/steps_${form}_${round}.json" --commit "${COMMIT:-unknown}" 2>&1 \
      | grep -E "^\[(variant|steps)\]" | tail -2
  done
done
echo "[session] $((SECONDS - START)) s"

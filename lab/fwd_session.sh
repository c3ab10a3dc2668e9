#!/usr/bin/env bash
# Device call (sm_90): the Gluon FP8 kernel by way (settings, the scales' layout) at the MoE's shapes, and on one
# dense group beside cuBLAS's blockwise _scaled_mm and bf16 mm (lab.probes.fp8_gluon_fwd); then the pipeline's
# ceiling without the promotion (lab.probes.fp8_gluon_ceiling; CEILING=0: not) and 64 x 256 tiles
# (lab.probes.fp8_gluon_wide; WIDE=0: not); after the FP8 GPU tests (TESTS: their -k, if any). In $OUT.
#   COMMIT=<sha> [TESTS=wide, after lab/dgrad_copy_session.sh ran them all] [CEILING=0] bash lab/fwd_session.sh
set -u
OUT=${OUT:-/tmp/fwd}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} \
  tests/ops/test_fp8_gpu.py > "$OUT/grouped_tests.txt" 2>&1  # the FP8 GPU tests (the wide kernel's in their own processes)
grep -E "passed|failed|^FAILED|^E  " "$OUT/grouped_tests.txt" | tail -6
timeout 300 python3 -m lab.probes.fp8_gluon_fwd > "$OUT/fwd_probe.txt" 2>&1; cat "$OUT/fwd_probe.txt" | grep -v Warning
[ "${CEILING:-1}" = 1 ] && timeout 150 python3 -m lab.probes.fp8_gluon_ceiling > "$OUT/ceiling_probe.txt" 2>&1; grep -v Warning "$OUT/ceiling_probe.txt"
[ "${WIDE:-1}" = 1 ] && timeout 150 python3 -m lab.probes.fp8_gluon_wide > "$OUT/wide_probe.txt" 2>&1; grep -v Warning "$OUT/wide_probe.txt"
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# Device call (sm_90): the input gradient on the weights' K-major copy (grouped.COPY_ROWS_PER_EXPERT): its GPU tests
# (bit for bit the in-kernel transposition's) and the other FP8 GPU tests, then lab.probes.fp8_dgrad_copy (both routes
# by rows per expert: the 256-expert slice at 16k / 64k tokens, one ep-8 rank at 8k / 16k; the copy's GB/s; the frozen
# MoE with the op's choice and each route forced). In $OUT.
#   COMMIT=<sha> bash lab/dgrad_copy_session.sh
set -u
OUT=${OUT:-/tmp/dgrad_copy}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} \
  tests/ops/test_fp8_gpu.py > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.txt" | tail -6
timeout "${PROBE_TIMEOUT:-270}" python3 -m lab.probes.fp8_dgrad_copy > "$OUT/dgrad_copy.txt" 2>&1
grep -v Warning "$OUT/dgrad_copy.txt"
echo "[session] $((SECONDS - START)) s"

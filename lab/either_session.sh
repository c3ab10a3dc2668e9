#!/usr/bin/env bash
# One device call that uses whichever sm_90 card came: on an H200 the targets (lab/targets_session.sh, PARTS
# "tests moe steps" unless set); on an H100, which cannot hold (d), every FP8 GPU test (the backward copy route's
# bitwise tests among them), then lab.probes.fp8_gluon_wide (the wide forward alone and in the frozen MoE), then
# lab.probes.fp8_dgrad_copy at the copy route's rows an expert (the slice at 64k, one ep-8 rank at 8k). In $OUT.
#   COMMIT=<sha> bash lab/either_session.sh
set -u
OUT=${OUT:-/tmp/either}; mkdir -p "$OUT"; START=$SECONDS
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PARTS=${PARTS:-tests moe steps} OUT=$OUT bash "$(dirname "$0")/targets_session.sh"; exit
fi
. "$(dirname "$0")/device_env.sh"
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/ops/test_fp8_gpu.py > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.txt" | tail -8; echo "[tests] $((SECONDS - START)) s"
timeout 140 python3 -m lab.probes.fp8_gluon_wide > "$OUT/wide_probe.txt" 2>&1; grep -v Warning "$OUT/wide_probe.txt"
echo "[wide] $((SECONDS - START)) s"
timeout $((575 - SECONDS + START)) python3 -m lab.probes.fp8_dgrad_copy slice:64k ep8:8k > "$OUT/dgrad_copy.txt" 2>&1
grep -v Warning "$OUT/dgrad_copy.txt"; echo "[session] $((SECONDS - START)) s"

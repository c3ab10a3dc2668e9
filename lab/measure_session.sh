#!/usr/bin/env bash
# One device call, in order of worth: the frozen MoE, then (d) / (a) / (c) at 16k side by side on the slice with the
# library's defaults (LoRA's term in the FP8 kernel since 4294d92; lab/finetune_moe_session.sh), then in the time
# left the MoE's bitwise tests and (a)'s step profile (lab/profile_session.sh, on the slice already written). In $OUT.
#   LIMIT=<s> COMMIT=<sha> [CASES="a:16384" on an H100, which cannot hold (c) or (d)] bash lab/measure_session.sh
set -u
OUT=${OUT:-/tmp/measure}; mkdir -p "$OUT"; START=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - (SECONDS - START) - ${1:-0})); }
STEPS_TIMEOUT=$(left 130) CASES="${CASES:-d:16384;a:16384;c:16384}" OUT="$OUT" COMMIT="${COMMIT:-unknown}" \
  bash "$(dirname "$0")/finetune_moe_session.sh" 2>&1
[ "$(left)" -gt 40 ] && OUT="$OUT" COMMIT="${COMMIT:-unknown}" timeout "$(left)" \
  bash "$(dirname "$0")/profile_session.sh" 2>&1 | grep -v "^\[checkpoint\]"
echo "[session] $((SECONDS - START)) s"

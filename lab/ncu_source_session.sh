#!/usr/bin/env bash
# Device call (sm_90): Nsight Compute's warp-stall samples per SASS instruction of the Gluon FP8 forward at the MoE's
# gate_up shape (the first launch of lab.probes.fp8_ncu; WHICH=trans: its input gradient), as CSV in $OUT/sass.csv,
# the report in $OUT/fwd.ncu-rep.
#   [WHICH=trans] COMMIT=<sha> bash lab/ncu_source_session.sh
set -u
OUT=${OUT:-/tmp/ncu}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 300 ncu --set full --import-source yes -k regex:"${NCU_K:-fp8_grouped}" -c 1 -o "$OUT/fwd" \
  python3 -m lab.probes.fp8_ncu ${WHICH:-} > "$OUT/ncu_log.txt" 2>&1; tail -3 "$OUT/ncu_log.txt"
ncu -i "$OUT/fwd.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
head -c 600 "$OUT/sass.csv"; echo; wc -l "$OUT/sass.csv"
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# Device call (sm_90): Nsight Compute's full set on one launch each of the Gluon FP8 forward, its pipeline ceiling
# and cuBLAS's blockwise GEMM (lab.probes.fp8_ncu). In $OUT.
#   COMMIT=<sha> bash lab/ncu_session.sh
set -u
OUT=${OUT:-/tmp/ncu}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 400 ncu --set full -k regex:"fp8_grouped|ceiling|gemm|xmma|sm90" -c 5 python3 -m lab.probes.fp8_ncu \
  > "$OUT/ncu.txt" 2>&1
grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Shared Memory Config|Block Size|Grid Size|Cluster|Achieved Occ|Issue Slots Busy|No Eligible|L1/TEX Hit|L2 Hit|DRAM Throughput|Shared.*Bank|One or More Eligible|ERR" "$OUT/ncu.txt" | head -150
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# One device call: where SWAP faults (lab.probes.fp8_swap_fault, each case in its own process); where none does, SWAP
# timed (lab.probes.fp8_gluon_swap); else lab/swap_locate.sh on the first faulting case (or CASE): where the fault
# is, and the kernels' SASS into $OUT. The GPU tests without SWAP and the LoRA probe: lab/measure_session.sh.
#   [CASE=ragged_bf16] bash lab/swap_fault_session.sh
set -u
START=$SECONDS; rm -f /tmp/swap_cases.txt
. "$(dirname "$0")/device_env.sh"
export TRITON_CACHE_DIR=/tmp/swap_cache
timeout 300 python3 -m lab.probes.fp8_swap_fault 2>&1 | tail -20 | tee /tmp/swap_cases.txt
echo "[cases] $((SECONDS - START)) s"
if ! grep -q FAILED /tmp/swap_cases.txt; then  # no fault: time it (the probe of kernels_session.sh)
  timeout 200 python3 -m lab.probes.fp8_gluon_swap 2>&1 | tail -24
  echo "[session] $((SECONDS - START)) s"
  exit 0
fi
OUT=${OUT:-/tmp/out} bash "$(dirname "$0")/swap_locate.sh" ${CASE:-}
echo "[session] $((SECONDS - START)) s"

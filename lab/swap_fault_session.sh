#!/usr/bin/env bash
# One device call: where SWAP faults (lab.probes.fp8_swap_fault, each case in its own process); where none does, SWAP
# timed (lab.probes.fp8_gluon_swap); else the faulting case under compute-sanitizer (the faulting instruction's
# offset) and the kernel's SASS into $OUT. The GPU tests without SWAP and the LoRA probe: lab/measure_session.sh.
#   CASE=ragged_bf16 bash lab/swap_fault_session.sh
set -u
START=$SECONDS
. "$(dirname "$0")/device_env.sh"
export TRITON_CACHE_DIR=/tmp/swap_cache
timeout 300 python3 -m lab.probes.fp8_swap_fault 2>&1 | tail -20 | tee /tmp/swap_cases.txt
echo "[cases] $((SECONDS - START)) s"
if ! grep -q FAILED /tmp/swap_cases.txt; then  # no fault: time it (the probe of kernels_session.sh)
  timeout 200 python3 -m lab.probes.fp8_gluon_swap 2>&1 | tail -24
  echo "[session] $((SECONDS - START)) s"
  exit 0
fi
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "sanitizer: ${CS:-none}"
if [ -n "$CS" ]; then
  timeout 150 "$CS" --tool memcheck --show-backtrace no python3 -m lab.probes.fp8_swap_fault "${CASE:-ragged_bf16}" 2>&1 \
    | grep -v "^=========$" | head -30
fi
echo "[sanitizer] $((SECONDS - START)) s"
DIS=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
mkdir -p "${OUT:-/tmp/out}/sass"
for f in $(find $TRITON_CACHE_DIR -name "fp8_grouped_gluon_kernel.cubin"); do
  d=$(basename "$(dirname "$f")")
  cp "$(dirname "$f")/fp8_grouped_gluon_kernel.json" "${OUT:-/tmp/out}/sass/$d.json" 2>/dev/null
  [ -n "$DIS" ] && "$DIS" -sass "$f" > "${OUT:-/tmp/out}/sass/$d.sass" 2>&1
done
ls -la "${OUT:-/tmp/out}/sass" | head
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# Where in the kernel a SWAP case faults: compute-sanitizer's report of the faulting instruction (Firecracker
# machines; gVisor refuses it), else a GPU core dump read by cuda-gdb (the faulting PC and its instructions); then the
# kernels' SASS from the Triton cache into $OUT/sass. Sourced env: device_env.sh.
#   TRITON_CACHE_DIR=/tmp/swap_cache bash lab/swap_locate.sh [CASE]
set -u
# the case: the argument, else the first that faulted in the fault matrix's last output (/tmp/swap_cases.txt)
CASE=${1:-$(grep -m1 -o "^[a-z0-9_]*: FAILED" /tmp/swap_cases.txt 2>/dev/null | cut -d: -f1)}
[ -n "$CASE" ] || { echo "no case: none faulted in /tmp/swap_cases.txt"; exit 0; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/sass"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "sanitizer: ${CS:-none}"
LOG=/tmp/swap_sanitizer.txt
if [ -n "$CS" ]; then
  timeout 150 "$CS" --tool memcheck --show-backtrace no python3 -m lab.probes.fp8_swap_fault "$CASE" > "$LOG" 2>&1
  grep -v "^=========$" "$LOG" | head -30
fi
# the core dump where the sanitizer cannot run here or found nothing (it serializes the kernels)
if [ -z "$CS" ] || ! grep -q -E "ERROR SUMMARY: [1-9]" "$LOG" 2>/dev/null; then
  GDB=$(command -v cuda-gdb || ls /usr/local/cuda*/bin/cuda-gdb 2>/dev/null | head -1)
  rm -f /tmp/swapcore.*
  CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 CUDA_COREDUMP_FILE=/tmp/swapcore.%p \
    timeout 120 python3 -m lab.probes.fp8_swap_fault "$CASE" 2>&1 | tail -3
  CORE=$(ls /tmp/swapcore.* 2>/dev/null | head -1)
  echo "core dump: ${CORE:-none}; cuda-gdb: ${GDB:-none}"
  if [ -n "$CORE" ] && [ -n "$GDB" ]; then
    timeout 60 "$GDB" -batch -ex "target cudacore $CORE" -ex "info cuda kernels" -ex "info cuda warps" \
      -ex 'x/12i $pc-0x60' 2>&1 | tail -40
  fi
fi
DIS=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
for f in $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name "fp8_grouped_gluon_kernel.cubin"); do
  d=$(basename "$(dirname "$f")")
  cp "$(dirname "$f")/fp8_grouped_gluon_kernel.json" "$OUT/sass/$d.json" 2>/dev/null
  [ -n "$DIS" ] && "$DIS" -sass "$f" > "$OUT/sass/$d.sass" 2>&1
done
ls "$OUT/sass" | head

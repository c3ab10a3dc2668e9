#!/usr/bin/env bash
# One device call, in order of worth:
# 0. LoRA's kernel unit test (it failed on an H100 at 506d052; a minute at most);
# 1. the frozen MoE, then (d) / (a) / (c) at 16k on the slice (lab/finetune_moe_session.sh, records in $OUT; (d)
#    first: (a) and (c) run LoRA's MoE kernels on a GPU for the first time, and a fault would end the process's CUDA
#    context and with it the cases after);
# 2. the FP8 ops' GPU tests that depend on neither SWAP nor INPLACE (the Gluon kernel with LoRA's term among them);
# 3. (a) at 16k with LoRA's term in the FP8 kernel, if its tests passed (lab/finetune_variant.py);
# 4. the MoE with LoRA unfused / fused (lab.probes.moe_lora_fused);
# 5. in the time left, where SWAP faults (lab.probes.fp8_swap_fault) and, for the first case that faults, where in
#    the kernel (lab/swap_locate.sh).
#   LIMIT=<s> COMMIT=<sha> [CASES="a:16384;c:16384" on an H100, which cannot hold (d)] bash lab/measure_session.sh
set -u
OUT=${OUT:-/tmp/measure}; mkdir -p "$OUT"; START=$SECONDS; LIMIT=${LIMIT:-570}; rm -f /tmp/swap_cases.txt
left() { echo $((LIMIT - (SECONDS - START) - ${1:-0})); }
. "$(dirname "$0")/device_env.sh" > /dev/null
# LoRA's kernel unit test with its assertion's detail (it failed on an H100 at 506d052, cut off before -rA printed)
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_lora_kernels_gpu.py -k test_kernels_vs_fp64 \
  > "$OUT/lora_kernels_test.txt" 2>&1; grep -E "^E |assert|passed|failed" "$OUT/lora_kernels_test.txt" | head -20
echo "[lora test] $((SECONDS - START)) s"
STEPS_TIMEOUT=$(left 260) CASES="${CASES:-d:16384;a:16384;c:16384}" OUT="$OUT" COMMIT="${COMMIT:-unknown}" \
  bash "$(dirname "$0")/finetune_moe_session.sh" 2>&1
. "$(dirname "$0")/device_env.sh" > /dev/null
timeout "$(left 200)" python3 -m pytest -q -s -rA -p no:cacheprovider -k "not swap and not inplace" \
  tests/ops/test_fp8_gpu.py > "$OUT/gpu_tests.txt" 2>&1
grep -E "gluon|moe lora|passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -24
echo "[tests] $((SECONDS - START)) s"
# (a) at 16k with LoRA's term in the FP8 kernel, if its GPU tests all passed above (lab/finetune_variant.py; its own
# JSON). INPLACE is left out: on an H100 at 506d052 it gave the frozen MoE nothing (19.68-19.90 ms against 19.72).
passed() { [ "$(grep -c "^PASSED .*$1" "$OUT/gpu_tests.txt")" -eq "$2" ] && ! grep -q "^FAILED .*$1" "$OUT/gpu_tests.txt"; }
if passed "test_gluon_low_rank_term_vs_same_operands" 12 && [ "$(left)" -gt 110 ]; then
  timeout "$(left 60)" python3 -m lab.finetune_variant --fuse-low-rank -- --ckpt /tmp/csattn_v4_flash_slice \
    --json "$OUT/finetune_variant.json" --parts steps --cases a:16384 --commit "${COMMIT:-unknown}" 2>&1 \
    | grep -E "^\[" | tail -6
fi
echo "[variant] $((SECONDS - START)) s"
WAYS="bf16,fp8,fp8 fused" timeout "$(left 40)" python3 -m lab.probes.moe_lora_fused 2>&1 | tail -12
echo "[lora] $((SECONDS - START)) s"
if [ "$(left)" -gt 40 ]; then
  TRITON_CACHE_DIR=/tmp/swap_cache timeout "$(left)" python3 -m lab.probes.fp8_swap_fault 2>&1 | tail -20 \
    | tee /tmp/swap_cases.txt
fi
if grep -q FAILED /tmp/swap_cases.txt 2>/dev/null && [ "$(left)" -gt 60 ]; then  # where the first fault is
  OUT="$OUT" TRITON_CACHE_DIR=/tmp/swap_cache timeout "$(left)" bash "$(dirname "$0")/swap_locate.sh" 2>&1 | tail -50
fi
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# One device call, in order of worth:
# 1. the frozen MoE, then (d) / (a) / (c) at 16k on the slice with the library's defaults (LoRA's term in the FP8
#    kernel since 4294d92; lab/finetune_moe_session.sh, records in $OUT);
# 2. the GPU tests of the input gradient's SWAP form (scales by global loads since 4294d92), each in its own process,
#    and the MoE's bitwise tests;
# 3. (a) at 16k with SWAP, if its tests all passed (lab/finetune_variant.py, its own JSON);
# 4. the input gradient both ways at the MoE's shapes and the frozen MoE with SWAP (lab.probes.fp8_gluon_swap);
# 5. the MoE with LoRA: bf16, FP8 with the term after / in the kernel, and with SWAP (lab.probes.moe_lora_fused).
#   LIMIT=<s> COMMIT=<sha> [CASES="a:16384;c:16384" on an H100, which cannot hold (d)] bash lab/measure_session.sh
set -u
OUT=${OUT:-/tmp/measure}; mkdir -p "$OUT"; START=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - (SECONDS - START) - ${1:-0})); }
STEPS_TIMEOUT=$(left 330) CASES="${CASES:-d:16384;a:16384;c:16384}" OUT="$OUT" COMMIT="${COMMIT:-unknown}" \
  bash "$(dirname "$0")/finetune_moe_session.sh" 2>&1
. "$(dirname "$0")/device_env.sh" > /dev/null
timeout "$(left 200)" python3 -m pytest -q -s -rA -p no:cacheprovider -k "swap or bitwise" tests/ops/test_fp8_gpu.py \
  > "$OUT/swap_tests.txt" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/swap_tests.txt" | tail -16
echo "[tests] $((SECONDS - START)) s"
if grep -q " passed" "$OUT/swap_tests.txt" && ! grep -q -E "^(FAILED|ERROR) .*swap" "$OUT/swap_tests.txt" \
    && [ "$(left)" -gt 140 ]; then
  timeout "$(left 80)" python3 -m lab.finetune_variant --swap -- --ckpt /tmp/csattn_v4_flash_slice \
    --json "$OUT/finetune_variant.json" --parts steps --cases a:16384 --commit "${COMMIT:-unknown}" 2>&1 \
    | grep -E "^\[" | tail -4
fi
echo "[variant] $((SECONDS - START)) s"
timeout "$(left 50)" python3 -m lab.probes.fp8_gluon_swap > "$OUT/swap_probe.txt" 2>&1; tail -16 "$OUT/swap_probe.txt"
echo "[probe] $((SECONDS - START)) s"
[ "$(left)" -gt 30 ] && WAYS="bf16,fp8,fp8 fused,fp8 swap fused" timeout "$(left)" python3 -m lab.probes.moe_lora_fused \
  > "$OUT/moe_lora.txt" 2>&1; tail -10 "$OUT/moe_lora.txt"
echo "[session] $((SECONDS - START)) s"

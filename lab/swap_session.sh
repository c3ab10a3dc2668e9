#!/usr/bin/env bash
# One device call for the input gradient's SWAP form with the activation's scales by global loads (SWAP_SETTINGS
# since the fault matrix at e80df6b): its GPU tests (each in its own process) and the MoE's bitwise test, then the
# input gradient both ways at the MoE's shapes and the frozen MoE (lab.probes.fp8_gluon_swap), then the MoE with LoRA
# with the term in the kernel, by default and with SWAP (lab.probes.moe_lora_fused). In $OUT.
#   COMMIT=<sha> bash lab/swap_session.sh
set -u
OUT=${OUT:-/tmp/swap}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 200 python3 -m pytest -q -s -rA -p no:cacheprovider -k "swap or bitwise" tests/ops/test_fp8_gpu.py \
  > "$OUT/swap_tests.txt" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|^E  |passed|failed" "$OUT/swap_tests.txt" | tail -24
echo "[tests] $((SECONDS - START)) s"
timeout 150 python3 -m lab.probes.fp8_gluon_swap 2>&1 | tee "$OUT/swap_probe.txt" | tail -24
echo "[probe] $((SECONDS - START)) s"
WAYS="bf16,fp8,fp8 fused,fp8 swap fused" timeout 100 python3 -m lab.probes.moe_lora_fused 2>&1 | tee "$OUT/swap_lora.txt" \
  | tail -10
echo "[session] $((SECONDS - START)) s"

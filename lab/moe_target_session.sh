#!/usr/bin/env bash
# One device call for issue 45's last target (the frozen-expert MoE at 16k, 1.3x bf16), on whichever card comes:
# the frozen MoE twice (benchmarks.finetune --parts moe), the GPU tests of the kernels changed since the last run
# (the SwiGLU kernels' quantized rows, the split transposition, the MoE's Triton kernels), where the MoE's time goes
# (lab.probes.moe_profile), its elementwise kernels over their launch settings (lab.probes.moe_launch_sweep), and the
# input gradient with a copier warp and two transposers (lab.probes.fp8_gluon_xpose3). In $OUT.
#   COMMIT=<sha> [PARTS="moe tests profile sweep xpose3"] bash lab/moe_target_session.sh
set -u
has() { case " ${PARTS:-moe tests profile sweep xpose3} " in *" $1 "*) return 0;; esac; return 1; }
OUT=${OUT:-/tmp/moe_target}; mkdir -p "$OUT"; START=$SECONDS; C=${COMMIT:-unknown}
. "$(dirname "$0")/device_env.sh"
has moe && for i in 1 2; do
  timeout 90 python3 -m benchmarks.finetune --ckpt /tmp/none --json "$OUT/finetune_moe_${C}_$i.json" --parts moe \
    --commit "$C" 2>&1 | grep -E "^(fp8|bf16|w8a16) " | tail -4
done
echo "[moe] $((SECONDS - START)) s"
has tests && { timeout 200 python3 -m pytest -q -p no:cacheprovider -k "rows or split or swiglu" tests/ops/test_fp8_gpu.py \
  > "$OUT/gpu_tests_fp8.txt" 2>&1; tail -2 "$OUT/gpu_tests_fp8.txt"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -k "triton_kernels or no_device_sync" tests/ops/test_moe_gpu.py \
  > "$OUT/gpu_tests_moe.txt" 2>&1; tail -2 "$OUT/gpu_tests_moe.txt"; }
echo "[tests] $((SECONDS - START)) s"
has profile && { timeout 90 python3 -m lab.probes.moe_profile > "$OUT/moe_profile.txt" 2>&1; grep -v Warn "$OUT/moe_profile.txt" | grep -v _warn; }
echo "[profile] $((SECONDS - START)) s"
has sweep && { timeout 150 python3 -m lab.probes.moe_launch_sweep > "$OUT/launch_sweep.txt" 2>&1; grep -v Warn "$OUT/launch_sweep.txt"; }
echo "[sweep] $((SECONDS - START)) s"
has xpose3 && { timeout 150 python3 -m lab.probes.fp8_gluon_xpose3 > "$OUT/xpose3_probe.txt" 2>&1; grep -v Warn "$OUT/xpose3_probe.txt" | tail -8; }
echo "[session] $((SECONDS - START)) s"

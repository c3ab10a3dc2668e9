#!/usr/bin/env bash
# Device call: the frozen-expert MoE (the finetune page's moe part), then (a) / (c) / (d) side by side at 16k on the
# V4-Flash slice written in the release format on the GPU (5 timed steps a case, the median). In $OUT.
#   [MOE=0] COMMIT=<sha> bash lab/finetune_moe_session.sh
set -u
OUT=${OUT:-/tmp/ftmoe}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
if [ "${MOE:-1}" = 1 ]; then  # MOE=0: the steps only
  timeout 90 python3 -m benchmarks.finetune --ckpt /tmp/none --json "$OUT/finetune_moe.json" --parts moe \
    --commit "${COMMIT:-unknown}" 2>&1 | grep -E "^(fp8|bf16|w8a16) " | tail -6
  echo "[moe] $((SECONDS - START)) s"
fi
timeout "${STEPS_TIMEOUT:-420}" python3 -m benchmarks.finetune --ckpt /tmp/csattn_v4_flash_slice --json "$OUT/finetune_steps.json" \
  --parts write,steps --draw device --steps 5 --cases "${CASES:-a:16384;c:16384;d:16384}" --commit "${COMMIT:-unknown}" 2>&1 \
  | grep -E "^\[" | tail -20
echo "[session] $((SECONDS - START)) s"

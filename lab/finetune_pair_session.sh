#!/usr/bin/env bash
# Device call: (a) frozen FP8 experts + LoRA, (c) frozen bf16 experts + LoRA and (d) everything trained, side by side
# at 16k tokens on the V4-Flash slice written in the release format on the GPU. In $OUT.
#   COMMIT=<sha> bash lab/finetune_pair_session.sh
set -u
OUT=${OUT:-/tmp/ftpair}; mkdir -p "$OUT"; START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 500 python3 -m benchmarks.finetune --ckpt /tmp/csattn_v4_flash_slice --json "$OUT/finetune_steps.json" \
  --parts write,steps --draw device --cases "${CASES:-a:16384;c:16384;d:16384}" --commit "${COMMIT:-unknown}" 2>&1 \
  | grep -E "^\[" | tail -20
echo "[session] $((SECONDS - START)) s"

#!/usr/bin/env bash
# Device call: the Gluon kernel's input gradient in its SWAP form (csattn.ops.fp8.gluon.SWAP_SETTINGS: W_e^T dY^T,
# the weight's operand read transposed into registers, no transposition in shared memory). Its GPU test (against
# fp64 on the same quantized operands, all cases, the same bits twice), then the probe: the grouped GEMMs both ways
# beside the forward and bf16 grouped_mm, and the frozen-expert MoE (forward + input gradient) with bf16 experts
# and FP8 both ways. If SWAP passes and wins, make it the default (launch_settings) and re-measure the MoE and (a):
# CASES="a:16384;c:16384;d:16384" bash lab/finetune_moe_session.sh.   bash lab/fp8_swap_session.sh
set -u
START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py -k "gluon_grouped" 2>&1 \
  | grep -E "gluon|passed|failed|Error|assert" | tail -20
echo "[tests] $((SECONDS - START)) s"
timeout 200 python3 -m lab.probes.fp8_gluon_swap 2>&1 | tail -16
echo "[session] $((SECONDS - START)) s"

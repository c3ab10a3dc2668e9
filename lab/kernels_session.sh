#!/usr/bin/env bash
# One device call for the two FP8 kernel forms built without a device: the low-rank term in the Gluon kernel's
# epilogue (gluon.FUSE_LOW_RANK) and the input gradient's SWAP form (gluon.SWAP_SETTINGS). The GPU tests of the FP8
# ops (both forms against fp64 on the same operands), LoRA's Triton kernels and the HF FP8 integration, then the two
# probes: the MoE with LoRA unfused / fused (lab.probes.moe_lora_fused), and the input gradient both ways with the
# frozen MoE (lab.probes.fp8_gluon_swap). Then turn on what passed and won, and measure the slice:
# CASES="a:16384;c:16384;d:16384" COMMIT=<sha> bash lab/finetune_moe_session.sh.   bash lab/kernels_session.sh
set -u
START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 260 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py tests/ops/test_lora_kernels_gpu.py \
  tests/integrations/test_integration_hf_fp8.py 2>&1 | grep -E "gluon|moe lora|passed|failed|Error|assert" | tail -40
echo "[tests] $((SECONDS - START)) s"
timeout 120 python3 -m lab.probes.moe_lora_fused 2>&1 | tail -12
echo "[lora] $((SECONDS - START)) s"
timeout 180 python3 -m lab.probes.fp8_gluon_swap 2>&1 | tail -24
echo "[session] $((SECONDS - START)) s"

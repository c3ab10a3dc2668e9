#!/usr/bin/env bash
# Device call: the Gluon kernel's LoRA term (csattn.ops.fp8.gluon.FUSE_LOW_RANK) on the H200. Its GPU tests (the
# kernel's epilogue and the op's route against fp64 on the same operands, both directions, ranks 16 / 8 / 32), the
# FP8 MoE tests, LoRA's Triton kernels (rank-r products through the row index, factor gradients, the term added in
# one pass), the HF FP8 integration's, then the MoE with LoRA three ways (bf16, FP8 unfused, FP8 fused) side by
# side. Once it passes, set FUSE_LOW_RANK = True and measure (a) / (d): CASES="a:16384;c:16384;d:16384" bash
# lab/finetune_moe_session.sh.   bash lab/lora_fused_session.sh
set -u
START=$SECONDS
. "$(dirname "$0")/device_env.sh"
timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py tests/ops/test_lora_kernels_gpu.py \
  tests/integrations/test_integration_hf_fp8.py 2>&1 | grep -E "gluon|moe lora|passed|failed|Error|assert" | tail -40
echo "[tests] $((SECONDS - START)) s"
timeout 150 python3 -m lab.probes.moe_lora_fused 2>&1 | tail -12
echo "[session] $((SECONDS - START)) s"

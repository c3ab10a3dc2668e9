#!/usr/bin/env bash
# Device call (sm_90): the forward that writes the experts' K-major copy (EMIT) and the MoE op keeping it
# (grouped.KEEP_FORWARD_COPY): their GPU tests (bit for bit), lab.probes.fp8_dgrad_copy at the slice's 16k (the
# forward both ways, the frozen MoE with the copy kept), then mode (a) at 16k alternating default / --keep-copy on the
# slice written in the release format. In $OUT. Where it wins, turn KEEP_FORWARD_COPY on and run
# lab/targets_session.sh on an H200.
#   COMMIT=<sha> bash lab/keep_copy_session.sh
set -u
OUT=${OUT:-/tmp/keep_copy}; mkdir -p "$OUT"; START=$SECONDS; C=${COMMIT:-unknown}; CK=/tmp/csattn_v4_flash_slice
. "$(dirname "$0")/device_env.sh"
timeout 130 python3 -m pytest -q -p no:cacheprovider -k "k_major or keeping or copy_equals" tests/ops/test_fp8_gpu.py \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.txt" | tail -8
echo "[tests] $((SECONDS - START)) s"
timeout 150 python3 -m lab.probes.fp8_dgrad_copy slice:16k > "$OUT/dgrad_copy.txt" 2>&1; grep -v Warning "$OUT/dgrad_copy.txt"
echo "[probe] $((SECONDS - START)) s"
timeout 40 python3 -m benchmarks.finetune --ckpt $CK --parts write --draw device --json "$OUT/write.json" --commit "$C" \
  2>&1 | grep -E "^\[" | tail -1
for way in keep-copy default keep-copy default; do
  flag=$([ $way = keep-copy ] && echo --keep-copy)
  timeout 45 python3 -m lab.finetune_variant $flag -- --ckpt $CK --json "$OUT/variant_${way}_$SECONDS.json" \
    --parts steps --steps 5 --cases "a:16384" --commit "$C" 2>&1 | grep -E "^\[(variant|steps)\] .*(KEEP|16384)"
done
echo "[session] $((SECONDS - START)) s"

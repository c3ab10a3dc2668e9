#!/usr/bin/env bash
# The fine-tuning must-shows on one lent H200, in one device call (<= 600 s); results land in $OUT.
#   bash lab/finetune_session.sh [PART ...]      PART: tests write steps logits moe ranks quality (default: all)
# Each part has its own time limit and the call a budget (BUDGET, default 585 s): a part that would start with
# under 20 s left is skipped. Estimated on the H200 (not yet measured): tests ~60 s; write ~200 s (the slice's
# release-format checkpoint, ~14 GB of MXFP4 + FP8: drawn on the host from the model's generators, ~45 s a layer,
# quantized on the GPU; reused when $CKPT holds it); moe ~30 s; steps + logits: one FP8 load, then ~120 s (modes
# a-d at 16k and 64k); ranks: two gloo ranks each loading their experts, then ~60 s; quality: a load, then ~100 s
# (tokenizer, 200 LoRA steps at 4k). Every load converts the experts from MXFP4 to FP8 on the host
# (load_pretrained's mxfp4_to_fp8): 2.4 s an expert on one CPU thread here, 1024 experts in the slice, so minutes
# even on 16 cores: until the loader converts on the GPU, run the parts in separate calls while the machine is warm
# (it keeps $CKPT only then): `tests write moe`, `steps logits`, `ranks`, `quality`.
# Installs nothing: tokenizers, matplotlib and transformers are on the machine; wheels carried in .whl (see
# /work/.library/device/README.md) are installed first when present.
set -u
OUT=${OUT:-/tmp/finetune_out}; mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/csattn_v4_flash_slice}
COMMIT=${COMMIT:-${CSATTN_COMMIT:-unknown}}; export CSATTN_COMMIT=$COMMIT
BUDGET=${BUDGET:-585}
PARTS=" ${*:-tests write steps logits moe ranks quality} "
export PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
START=$SECONDS
has() { [[ "$PARTS" == *" $1 "* ]]; }
run() {  # run NAME LIMIT_S COMMAND...: within the budget, output to the log, exit status and seconds after it
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then echo "[$name] skipped: ${left} s of the budget left" | tee -a "$LOG"; return; fi
  ((limit > left)) && limit=$left
  echo "[$name] (at most ${limit} s) $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  echo "[$name] rc $? in $((SECONDS - t0)) s" | tee -a "$LOG"
}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
CONFIG=${CONFIG:-benchmarks/configs/v4_flash_slice.json}
FT="python3 -m benchmarks.finetune --config $CONFIG --ckpt $CKPT --json $OUT/finetune.json --commit $COMMIT"

if has tests; then  # the GPU tests of the fine-tuning work, those this tree has
  T=$(ls tests/ops/test_fp8_gpu.py tests/ops/test_fp8.py tests/models/test_fp8_model.py tests/ops/test_moe_lora.py \
      tests/finetune 2>/dev/null | tr '\n' ' ')
  run tests 90 sh -c "python3 -m pytest -q -p no:cacheprovider -m gpu $T > $OUT/gpu_tests.txt 2>&1"
  tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"
fi
has write && run write 280 $FT --parts write  # the slice's checkpoint into $CKPT, quantized on the GPU
STEPS=""; has steps && STEPS=steps; has logits && STEPS="${STEPS:+$STEPS,}logits"
[ -n "$STEPS" ] && run "$STEPS" 300 $FT --parts "$STEPS"
has moe && run moe 60 $FT --parts moe
has ranks && run ranks 240 $FT --parts ranks --rank-timeout 220
if has quality; then
  BP=""; python3 -m csattn train --help 2>/dev/null | grep -q -- "--base-precision" && BP="--base-precision fp8"
  run quality 280 python3 -m benchmarks.finetune_quality --out /tmp/quality --timeout 260 --commit "$COMMIT" -- \
    --init-from "$CKPT" --device cuda --dtype bfloat16 --seq-len 4096 --steps 200 --lr 2e-4 --warmup-steps 10 \
    --doc-min-len 128 --doc-max-len 4096 --lora-rank 16 --lora-alpha 32 \
    --lora-targets attention,indexer,shared_experts,experts $BP --log-every 20 --export-hf never
  cp /tmp/quality/quality.json /tmp/quality/loss.png "$OUT/" 2>/dev/null
fi
echo "[session] $((SECONDS - START)) s" | tee -a "$LOG"

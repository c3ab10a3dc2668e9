#!/usr/bin/env bash
# The fine-tuning must-shows on one fresh H200, in ONE device call of at most 560 s, start-up included; results
# land in $OUT (at most 8 files: session.log, gpu_tests.txt, finetune.json, quality.json, quality_metrics.jsonl,
# loss.png).
#   bash lab/finetune_session.sh [PART ...]   PART: tests write steps moe quality ranks (default: all, in that order)
#   TINY=1 bash lab/finetune_session.sh       the same flow on the CPU with a tiny geometry (proves the script)
#   COMMIT=<sha> names the tree measured: pass it from here (at 225fe84 the device copy's git metadata said b398979)
# Parts run in priority order, each under its own cap, within BUDGET (default 545 s: the call's 560 s less its
# start-up); a part is cut to what the budget has left and skipped under 20 s. Every part writes its JSON as it
# goes (finetune.json after each record, quality.json before and after training, the trainer's metrics.jsonl each
# step), so a part cut by its cap still leaves what it measured.
# Expected on the H200 (estimated from CPU timings scaled and the planner's step times; not yet measured):
#   start-up (wheels, torch import)        ~15 s
#   tests   (fp8 ops, fp8 model, MoE LoRA) ~50 s   cap  60  (mostly Triton compiles)
#   write   (slice, release format, drawn on the GPU: --draw device) ~75 s   cap 110  (~14 GB of MXFP4 + FP8 written)
#   steps   (+ logits): load with MXFP4 -> FP8 on the GPU ~40 s; (a) FP8 + LoRA 16k, 64k ~60 s (first compiles);
#           (b) w8a16 + LoRA 16k ~20 s; (c) bf16 experts + LoRA 16k, 64k ~35 s; (d) all trained 16k ~15 s (out
#           of memory: recorded); logits FP8 vs w8a16 ~10 s                ~180 s   cap 200
#   moe     (frozen experts fwd + input grad, 256 x top-6, 16k: fp8, w8a16, bf16) ~35 s   cap  50
#   quality (tokenizer, load ~40 s, 200 LoRA steps at 2048 tokens with --base-precision fp8) ~110 s   cap 130
#           (2048, not 4096, tokens a step: the part must fit what the budget leaves)
#   ranks   (2 gloo ranks, ep 2, one GPU)   only with what is left (>= 90 s): normally skipped
#   total ~505 s of 545.
# Installs nothing: wheels carried in .whl (peft; see /work/.library/device/README.md) are installed first.
set -u
TINY=${TINY:-0}
OUT=${OUT:-/tmp/finetune_out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-${CSATTN_COMMIT:-unknown}}; export CSATTN_COMMIT=$COMMIT
PARTS=" ${*:-tests write steps moe quality ranks} "
export PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
START=$SECONDS
if [ "$TINY" = 1 ]; then  # the CPU proof: a 4-layer geometry (D 64, I 128, 8 experts), tiny lengths
  BUDGET=${BUDGET:-1500}; DEVICE=cpu; X=4  # caps x4: two shared CPU cores
  CKPT=${CKPT:-/tmp/csattn_tiny_slice}; mkdir -p /tmp/csattn_tiny
  CONFIG=/tmp/csattn_tiny/config.json
  python3 -c "
import json; from tests.models.model_utils import tiny_config_dict
raw = tiny_config_dict('flash', mtp=1); raw.update(hidden_size=64, moe_intermediate_size=128, n_routed_experts=8,
                                                   vocab_size=512)
json.dump(raw, open('$CONFIG', 'w'))"
  CASES="a:64,128;b:64;c:64,128;d:64"; SIZES="--steps 1 --logits-tokens 64 --moe-tokens 64 --rank-tokens 64"
  QPRE="--vocab 320 --max-docs 40"; QTRAIN="--device cpu --dtype float32 --seq-len 128 --steps 12 --log-every 4"
  RANK_MIN=20
else
  BUDGET=${BUDGET:-545}; DEVICE=cuda; X=1
  CKPT=${CKPT:-/tmp/csattn_v4_flash_slice}
  CONFIG=${CONFIG:-benchmarks/configs/v4_flash_slice.json}
  CASES="a:16384,65536;b:16384;c:16384,65536;d:16384"; SIZES=""
  QPRE=""; QTRAIN="--device cuda --dtype bfloat16 --seq-len 2048 --steps 200 --log-every 20"
  RANK_MIN=90
fi
has() { [[ "$PARTS" == *" $1 "* ]]; }
left() { echo $((BUDGET - (SECONDS - START))); }
cap() { local c=$(($1 * X)) l; l=$(left); ((c > l)) && c=$l; echo $c; }
run() {  # run NAME CAP_S COMMAND...: within the budget, output to the log, exit status and seconds after it
  local name=$1 limit; limit=$(cap "$2"); shift 2
  if ((limit < 20)); then echo "[$name] skipped: $(left) s of the budget left" | tee -a "$LOG"; return 1; fi
  echo "[$name] (at most ${limit} s, at $((SECONDS - START)) s) $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  echo "[$name] rc $? in $((SECONDS - t0)) s" | tee -a "$LOG"
}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
echo "[session] start-up $((SECONDS - START)) s" | tee -a "$LOG"
FT="python3 -m benchmarks.finetune --config $CONFIG --ckpt $CKPT --json $OUT/finetune.json --commit $COMMIT
    --device $DEVICE $SIZES"

if has tests; then  # (i) the GPU tests of the fine-tuning work
  T=$(ls tests/ops/test_fp8_gpu.py tests/ops/test_fp8.py tests/models/test_fp8_model.py \
      tests/models/test_fp8_model_gpu.py tests/ops/test_moe_lora.py 2>/dev/null | tr '\n' ' ')
  run tests 60 sh -c "python3 -m pytest -v -p no:cacheprovider -m gpu $T > $OUT/gpu_tests.txt 2>&1"  # -v: a line a test
  tail -3 "$OUT/gpu_tests.txt" | tee -a "$LOG"
fi
# (ii) the slice's release-format checkpoint, drawn and quantized on the device
has write && run write 110 $FT --parts write --draw device
# (iii) + (iv, logits) the steps of modes a-d and the logits FP8 vs w8a16, one load
has steps && run steps 200 $FT --parts steps,logits --cases "$CASES"
# (iv) the frozen-expert MoE alone
has moe && run moe 50 $FT --parts moe
if has quality; then  # (v) 200 LoRA steps on real text, the trained tokenizer, an FP8 base
  QCAP=${QCAP:-130}  # the 225fe84 call: 105 s ran out before the first step (load, tokenizer, compiles); alone:
  Q=$(cap "$QCAP")  #   QCAP=500 bash lab/finetune_session.sh write quality
  run quality "$QCAP" python3 -m benchmarks.finetune_quality --out /tmp/quality --timeout $((Q - 25)) \
    --commit "$COMMIT" $QPRE -- --init-from "$CKPT" --base-precision fp8 --lr 2e-4 --min-lr 2e-5 --warmup-steps 10 \
    --doc-min-len 128 --doc-max-len 4096 --lora-rank 16 --lora-alpha 32 \
    --lora-targets attention,indexer,shared_experts,experts --export-hf never $QTRAIN
  cp /tmp/quality/quality.json /tmp/quality/loss.png "$OUT/" 2>/dev/null
  cp /tmp/quality/metrics.jsonl "$OUT/quality_metrics.jsonl" 2>/dev/null
fi
if has ranks; then  # (vi) 2 gloo ranks, ep 2, sharing the device: only with the time it takes
  if (($(left) >= RANK_MIN * X)); then
    L=$(left); run ranks "$L" $FT --parts ranks --rank-timeout $((L - 10))
  else
    echo "[ranks] skipped: $(left) s left (needs $((RANK_MIN * X)))" | tee -a "$LOG"
  fi
fi
echo "[session] $((SECONDS - START)) s" | tee -a "$LOG"

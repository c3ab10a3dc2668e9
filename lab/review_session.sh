#!/usr/bin/env bash
# One device call after the review of the trainer, the planner and the kernel settings (and the FP8 fixes): the FP8
# GPU tests, the proxy step at the commit before the review and now (alternated), then the GPU tests of the code the
# review touched, each part capped within BUDGET seconds.   BEFORE=<sha> AFTER=<sha> bash lab/review_session.sh
set -u
OUT=${OUT:-/tmp/review}; mkdir -p "$OUT"; BUDGET=${BUDGET:-520}; START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
tests() {  # tests NAME CAP FILES...: pytest -m gpu, a line per test
  local name=$1 cap=$2; shift 2; local l; l=$(left); ((cap > l)) && cap=$l
  ((cap < 20)) && { echo "[$name] skipped"; return; }
  timeout -k 5 "$cap" python3 -m pytest -v -s -p no:cacheprovider -m gpu "$@" > "$OUT/tests_$name.txt" 2>&1
  echo "[$name] rc $? in $cap s cap at $((SECONDS - START)) s: $(grep -cE ' PASSED' "$OUT/tests_$name.txt") passed," \
    "$(grep -cE ' FAILED' "$OUT/tests_$name.txt") failed"
}
tests fp8 170 tests/models/test_fp8_model_gpu.py tests/integrations/test_integration_hf_fp8.py tests/ops/test_fp8_gpu.py \
  tests/ops/test_moe_lora.py
step() {  # step DIR SHA I
  local l; l=$(left); ((l < 60)) && { echo "[step $2] skipped"; return; }
  (cd "$1" && timeout 150 python3 -m benchmarks.run --op model --mode fwdbwd --providers csattn --shape tokens=16384 \
    --warmup-ms 5 --rep-ms 30 --commit "$2" --json "$OUT/step_$2_$3.json" 2>&1 | grep -E "^csattn" | sed "s/^/[$2 $3] /")
}
step .before "$BEFORE" 1; step . "$AFTER" 1
tests review 150 tests/ops/test_sparse_attn_deterministic.py tests/ops/test_indexer_loss_deterministic.py \
  tests/ops/test_mhc_triton.py tests/capture_safe/test_graphs_gpu.py tests/models/test_model_autocast.py \
  tests/ops/test_sparse_attn_gluon.py
step .before "$BEFORE" 2; step . "$AFTER" 2
echo "[session] $((SECONDS - START)) s"

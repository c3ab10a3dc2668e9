#!/usr/bin/env bash
# The proxy's training step at two commits in one device call, alternated (A B A B) so that drift shows:
#   BEFORE_DIR=.before BEFORE=<sha> AFTER=<sha> bash lab/proxy_step_pair.sh
# BEFORE_DIR holds `git archive <sha> csattn benchmarks pyproject.toml` of the earlier commit (carried to the device);
# the working tree is the later one. Writes $OUT/step_<sha>_<i>.json and prints each table.
set -u
OUT=${OUT:-/tmp/step_pair}; mkdir -p "$OUT"
ARGS="--op model --mode fwdbwd --providers csattn --shape tokens=${TOKENS:-16384} --warmup-ms 5 --rep-ms 30"
for i in 1 2; do
  (cd "$BEFORE_DIR" && timeout 150 python3 -m benchmarks.run $ARGS --commit "$BEFORE" --json "$OUT/step_${BEFORE}_$i.json" \
    2>&1 | grep -E "^csattn|provider|commit")
  timeout 150 python3 -m benchmarks.run $ARGS --commit "$AFTER" --json "$OUT/step_${AFTER}_$i.json" 2>&1 \
    | grep -E "^csattn|provider|commit"
done

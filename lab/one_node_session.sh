#!/usr/bin/env bash
# The one-node fine-tuning run, for a machine of 8 GPUs of one host (run kind nvidia-h200-x8; not yet lent): the
# planner's mesh for V4-Flash at 64k tokens, V4-Flash written in the release's format on GPU 0 (synthetic weights at
# the model's scales: FP8 dense linears, MXFP4 experts; about 160 GB on disk), then LoRA over the frozen FP8 experts
# through csattn train on that mesh under torchrun, each rank's peak into $OUT/peaks/rank{R}.json beside the
# planner's per-rank peak, and the steps' metrics into $OUT/one_node.jsonl.
#   OUT=$OUT bash lab/one_node_session.sh
# CONFIG, SEQ, STEPS, GPUS, CKPT, PLAN_FLAGS (fixed flags for the planner's search) change the defaults. Its plumbing,
# checked on a CPU (2 gloo ranks, the tiny 4-layer geometry of tests/benchmarks/test_finetune.py, 2 steps, 108 s):
#   CONFIG=tiny.json SEQ=1024 STEPS=2 GPUS=2 DEVICE=cpu DIST=gloo PLAN_FLAGS="--cp 2 --ep 2 --dp-shard 1 \
#   --batch-seqs 1" bash lab/one_node_session.sh
set -u
OUT=${OUT:-/tmp/one_node}; mkdir -p "$OUT/peaks"; START=$SECONDS
CONFIG=${CONFIG:-benchmarks/configs/v4_flash.json}; SEQ=${SEQ:-65536}; STEPS=${STEPS:-6}; GPUS=${GPUS:-8}
CKPT=${CKPT:-/tmp/v4_flash_release}; DEVICE=${DEVICE:-cuda}; DIST=${DIST:-nccl}
[ "$DEVICE" = cuda ] && . "$(dirname "$0")/device_env.sh"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m csattn plan --config "$CONFIG" --gpus "$GPUS" --seq-len "$SEQ" --lora-rank 16 --search ${PLAN_FLAGS:-} \
  > "$OUT/plan.txt" 2>&1
grep -E "^fit|peak:|step time" "$OUT/plan.txt"
# the mesh and flags the planner prints ("run it:"), without the launcher and the placeholder
MESH=$(grep -A1 "^run it:" "$OUT/plan.txt" | tail -1 | sed -E 's/.* -m csattn train --init-from CHECKPOINT_DIR //')
[ -n "$MESH" ] || { echo "the planner printed no mesh: $OUT/plan.txt"; exit 1; }
echo "[plan] $((SECONDS - START)) s: $MESH"
python3 -c "import sys; from benchmarks.finetune import write_checkpoint as w; print(w(*sys.argv[1:4], draw='device'))" \
  "$CONFIG" "$CKPT" "$DEVICE"
echo "[write] $((SECONDS - START)) s"
[ "$DEVICE" = cuda ] || MESH=$(echo "$MESH" | sed -E 's/--dtype bfloat16/--dtype float32/')
timeout "${TRAIN_TIMEOUT:-400}" python3 -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
  -m benchmarks.finetune --rank-peaks "$OUT/peaks" -- --init-from "$CKPT" $MESH --device "$DEVICE" \
  --dist-backend "$DIST" --steps "$STEPS" --warmup-steps 1 --export-hf never --no-progress --log-every 1 \
  --metrics "$OUT/one_node.jsonl" --output "${RUN_DIR:-/tmp/one_node_run}" 2>&1 | tail -20
echo "[train] rc ${PIPESTATUS[0]} in $((SECONDS - START)) s"
python3 - "$OUT" <<'EOF'
import glob, json, re, sys
out = sys.argv[1]
plan = float(re.search(r"peak: ([\d.]+) GiB per rank", open(f"{out}/plan.txt").read()).group(1))
peaks = {int(re.search(r"rank(\d+)", p).group(1)): json.load(open(p)) for p in glob.glob(f"{out}/peaks/rank*.json")}
for r in sorted(peaks):
    got = peaks[r]["peak_gib"]
    print(f"rank {r}: peak {got} GiB, planned {plan:.2f} ({plan / got:.2f}x)" if got else f"rank {r}: {peaks[r]}")
steps = [json.loads(line) for line in open(f"{out}/one_node.jsonl")] if glob.glob(f"{out}/one_node.jsonl") else []
print("steps:", [(s.get("step"), s.get("loss"), s.get("tokens_per_s")) for s in steps][-4:])
EOF
echo "[session] $((SECONDS - START)) s"

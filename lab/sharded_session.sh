#!/usr/bin/env bash
# Sharded training on the one lent H200 (one device call, about 8 min): csattn train at world size 1 on the
# 4-layer V4-Flash proxy beside the last commit before the sharded loop (61ffd13, carried as .old), the one-GPU
# peaks at 64k / 128k the planner predicts, and FSDP2 + EP + CP on 2 and 4 gloo ranks sharing the GPU.
#   here:  git archive 61ffd13 | tar -x -C .old   (.old in .git/info/exclude)
#   call:  OUT=$OUT bash lab/sharded_session.sh       (carry .old)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
OUT=${OUT:-out}
P=benchmarks/configs/v4_flash_proxy.json
RUN="--config-json $P --device cuda --dtype bfloat16 --lr 3e-4 --min-lr 3e-5 --warmup-steps 20 --doc-min-len 256 \
--doc-max-len 8192 --no-progress --log-every 20"
t() { local s=$SECONDS; echo "== $*"; timeout "$@"; echo "== rc $? in $((SECONDS - s)) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t 150 python -m csattn train $RUN --seq-len 16384 --steps 60 --export-hf never --metrics $OUT/w1_16k_new.jsonl
(cd .old && t 150 python -m csattn train $RUN --seq-len 16384 --steps 60 --metrics ../$OUT/w1_16k_old.jsonl)
t 100 python -m csattn train $RUN --seq-len 65536 --steps 5 --export-hf never --metrics $OUT/w1_64k.jsonl
t 100 python -m csattn train $RUN --seq-len 131072 --steps 4 --export-hf never --metrics $OUT/w1_128k.jsonl
G="$RUN --seq-len 8192 --batch-seqs 4 --steps 3 --export-hf never --dist-backend gloo --dist-timeout 120"
t 60 python -m csattn train $G --metrics $OUT/gloo_w1.jsonl
t 150 torchrun --standalone --nproc-per-node 2 -m csattn train $G --dp-shard 2 --ep 2 --metrics $OUT/gloo_2.jsonl
t 150 torchrun --standalone --nproc-per-node 4 -m csattn train $G --dp-shard 2 --cp 2 --ep 2 --metrics $OUT/gloo_4.jsonl

#!/usr/bin/env bash
# Deterministic mode on one H200 (one device call, about 6 to 8 min): the GPU tests of the fixed-point key gradients
# (bitwise equal over repeated runs with keys shared by thousands of rows, accuracy as the default path's, a CSA
# layer's whole backward bitwise; the Gluon backward's fixed-point variant, SparseAttnAblation.gluon_fixed = 1 / 2,
# bitwise and as accurate as the Triton pair), then the costs side by side: sparse-attention backward at 8k / 32k
# (default = Gluon, deterministic = Triton pair in fixed point, the Triton pair with fp32 atomics, to separate the two
# costs, and the Gluon fixed-point variant in its two column layouts), the indexer-loss backward, and the proxy model
# step at 16k (default vs every layer deterministic).
#   call:  OUT=$OUT bash lab/deterministic_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-out}
mkdir -p "$OUT"
t() { local s=$SECONDS; echo "== $*"; timeout "$@"; echo "== rc $? in $((SECONDS - s)) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t 240 python -m pytest -q -m gpu -rA tests/ops/test_sparse_attn_deterministic.py \
    tests/ops/test_indexer_loss_deterministic.py 2>&1 | tee "$OUT/gpu_tests_deterministic.txt" | tail -20
t 200 python -m benchmarks.run --op sparse_attn --mode bwd \
    --providers 'triton,triton[deterministic=1],triton[bwd_gluon=0],triton[deterministic=1,gluon_fixed=1],triton[deterministic=1,gluon_fixed=2]' \
    --shape tokens=8192,32768 \
    --warmup-ms 10 --rep-ms 100 --json "$OUT/sparse_attn_bwd_deterministic.json"
t 40 python -m benchmarks.run --op indexer_loss --mode bwd --providers 'triton,triton[deterministic=1]' \
    --warmup-ms 10 --rep-ms 50 --json "$OUT/indexer_loss_bwd_deterministic.json"
t 90 python -m benchmarks.run --op model --mode fwdbwd --providers 'csattn,csattn[deterministic]' \
    --shape tokens=16384 --warmup-ms 5 --rep-ms 30 --json "$OUT/model_deterministic.json"

#!/usr/bin/env bash
# Deterministic mode on one H200 (one device call, about 8 min): the GPU tests of the fixed-point key gradients
# (bitwise equal over repeated runs with keys shared by thousands of rows, accuracy as the default path's, a CSA
# layer's whole backward bitwise, the Gluon backward's fixed-point variant), the results page's "deterministic"
# stage (sparse-attention backward at 8k / 32k: default, deterministic, and the Triton pair in fixed point; the
# indexer-loss backward; the proxy step at 16k with and without), then the GPU tests of mixed precision and the HF
# integration (transformers 5.23 from .whl, carried).
#   call:  OUT=$OUT CSATTN_COMMIT=<sha> bash lab/deterministic_session.sh      (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-out}
mkdir -p "$OUT"
t() { local s=$SECONDS; echo "== $*"; timeout "$@"; echo "== rc $? in $((SECONDS - s)) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t 240 python -m pytest -q -m gpu -rA tests/ops/test_sparse_attn_deterministic.py \
    tests/ops/test_indexer_loss_deterministic.py 2>&1 | tee "$OUT/gpu_tests_deterministic.txt" | tail -20
t 330 python -m benchmarks.results --measure --commit "${CSATTN_COMMIT:?set CSATTN_COMMIT}" --json-dir "$OUT" \
    --budget-s 300 --stages deterministic
mkdir -p /tmp/site && python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
PYTHONPATH="/tmp/site:$PWD" t 200 python -m pytest -q -m gpu -rA tests/layers/test_dtypes.py tests/ops/test_moe.py \
    tests/models/test_model_autocast.py tests/integrations -k "autocast or bf16" 2>&1 \
    | tee "$OUT/gpu_tests_mixed_precision.txt" | tail -25

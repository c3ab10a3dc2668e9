#!/usr/bin/env bash
# Everything this project measures on the lent H200 (the device time is scarce): GPU tests, the layer
# benchmark against HF eager, and the scaling report. Results land in $OUT.
#   CSATTN_COMMIT=<sha> bash benchmarks/gpu_session.sh   (.whl/ carries transformers 5.23 if the image's is older)
# Stage time limits: TESTS_S, LAYER_S, REPORT_S (seconds). The full report (6 lengths x 2 layers x CP 1/2/4 x
# both partitions, isolated per-rank timing) needs about 15 minutes: give it a call of its own.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD"
fi
stage() { echo "=== $1 ($(date -u +%T))" | tee -a "$LOG"; }
stage env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$LOG" 2>&1
git rev-parse --short HEAD >> "$LOG" 2>&1 || true

stage "gpu tests"
timeout "${TESTS_S:-110}" python3 -m pytest -q -m gpu tests -p no:cacheprovider >> "$LOG" 2>&1
echo "pytest rc=$?" >> "$LOG"

stage "layer benchmark: Triton / reference / HF eager"
timeout "${LAYER_S:-150}" python3 -m benchmarks.run --op layer --mode fwdbwd --providers triton,reference,hf \
  --shape tokens=8192,32768 --shape layer=csa,hca --warmup-ms 5 --rep-ms 40 --commit "${CSATTN_COMMIT:-unknown}" \
  --json "$OUT/layer.json" >> "$LOG" 2>&1
echo "layer rc=$?" >> "$LOG"

stage "scaling report"
timeout "${REPORT_S:-300}" python3 -m csattn report --tokens 4096 8192 16384 32768 65536 131072 \
  --reference-max-tokens "${REF_MAX:-8192}" --hf-max-tokens 8192 --steps "${STEPS:-2}" --group-timeout 240 \
  --out "$OUT/report" >> "$LOG" 2>&1
echo "report rc=$?" >> "$LOG"
stage done

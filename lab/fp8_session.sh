#!/usr/bin/env bash
# The FP8 ops on a lent H200 in one device call (~6 min): the GPU tests, then the fp8 benchmarks (quantizer, linear
# and its input-gradient routes, grouped GEMMs at 8x2 and 256x6, the frozen-expert MoE). Results land in $OUT.
#   bash lab/fp8_session.sh
set -u
OUT=${OUT:-/tmp/fp8out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
B="python3 -m benchmarks.run --warmup-ms 10 --rep-ms 60 --commit ${COMMIT:-unknown}"
timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py 2>&1 | tail -60 > "$OUT/fp8_gpu_tests.txt"
tail -3 "$OUT/fp8_gpu_tests.txt"
{
timeout 80 $B --op fp8_grouped --providers fp8,w8a16,bf16 --mode fwd --shape gemm=gate_up,down,gate_up_t,down_t \
  --json "$OUT/grouped.json"
timeout 50 $B --op moe_frozen --providers fp8,w8a16,bf16 --mode fwd,fwdbwd --json "$OUT/moe_frozen.json"
timeout 35 $B --op fp8_linear --providers fp8,w8a16,bf16 --mode fwd,bwd --json "$OUT/linear.json"
timeout 25 $B --op fp8_linear --providers "dgrad[copy],dgrad[bf16],dgrad[triton],dgrad[triton_w8a16]" --mode fwd \
  --json "$OUT/dgrad.json"
timeout 15 $B --op fp8_quant --providers triton,reference --mode fwd --json "$OUT/quant.json"
timeout 40 $B --op fp8_grouped --providers fp8,w8a16,bf16 --mode fwd --shape routing=8x2 --shape gemm=gate_up,down_t \
  --json "$OUT/grouped8.json"
} 2>&1 | grep -v "^\s*File\|^Traceback" | tee "$OUT/bench.txt"

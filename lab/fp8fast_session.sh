#!/usr/bin/env bash
# The Gluon FP8 grouped GEMM on a lent H200 in one device call (~4 min): a smoke launch (a hang or a fault stops
# here), its GPU tests and the MoE ones, then the grouped GEMMs (Gluon `fp8`, the Triton route `fp8[triton]`, bf16
# grouped_mm) and the frozen-expert MoE at 256x6. Results land in $OUT.
#   COMMIT=<hash> bash lab/fp8fast_session.sh
set -u
OUT=${OUT:-/tmp/fp8out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 60 python3 - <<'PY' 2>&1 | tail -15 | tee "$OUT/smoke.txt"
import torch
from csattn.ops.fp8 import fp8_grouped_mm_quantized, quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
g = torch.Generator(device="cuda").manual_seed(0)
for trans in (False, True):
    e, n, k = 8, 256, 512
    q = (torch.randn(e, n, k, generator=g, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e, n // 128, k // 128, generator=g, device="cuda") * 1e-3 + 1e-3
    offs = torch.randint(0, 200, (e,), generator=g, device="cuda").cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 9
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    qa, sa = quantize_1x128(a)
    out = grouped_mm_gluon(qa, sa, q, s, offs, trans, out_dtype=torch.float32)
    torch.cuda.synchronize()
    ad = qa.double() * sa.double().repeat_interleave(128, dim=-1)
    ref = fp8_grouped_mm_quantized(ad, q, s, offs, trans, quantize_a=False)
    print("smoke trans", trans, "rel err", ((out.double() - ref).norm() / ref.norm()).item())
PY
if [ "${PIPESTATUS[0]}" != 0 ] || ! grep -q "smoke trans True" "$OUT/smoke.txt"; then echo "SMOKE FAILED"; exit 1; fi
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_fp8_gpu.py -k "gluon or moe" 2>&1 | tail -40 \
  > "$OUT/fp8_gpu_tests.txt"
grep "gluon\|moe\|passed\|failed" "$OUT/fp8_gpu_tests.txt" | tail -24
B="python3 -m benchmarks.run --warmup-ms 10 --rep-ms 60 --commit ${COMMIT:-unknown}"
{
timeout 100 $B --op fp8_grouped --providers "fp8,fp8[triton],bf16" --mode fwd \
  --shape gemm=gate_up,down,gate_up_t,down_t --json "$OUT/grouped.json"
timeout 60 $B --op moe_frozen --providers fp8,bf16 --mode fwd,fwdbwd --json "$OUT/moe_frozen.json"
} 2>&1 | grep -v "^\s*File\|^Traceback" | tee "$OUT/bench.txt"

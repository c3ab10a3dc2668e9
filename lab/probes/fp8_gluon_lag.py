"""The Gluon FP8 grouped GEMM's input gradient (``trans``) at the MoE shapes (256 experts top-6, 16k tokens, D 4096,
I 2048) for each transposition lag, on prequantized operands; each output against LAG=1's bit for bit (the math
is the same). Prints ms and TFLOP/s. Run on an H200: python lab/probes/fp8_gluon_lag.py"""

import torch
import triton

from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from csattn.ops.moe import route_plan

g = torch.Generator(device="cuda").manual_seed(0)
tokens, e, k, d, inter = 16384, 256, 6, 4096, 2048
ids = torch.topk(torch.randn(tokens, e, device="cuda", generator=g), k, dim=-1).indices
offs = route_plan(ids, e).offs
m = tokens * k


def run(name: str, n_w: int, k_w: int) -> None:
    q = (torch.randn(e, n_w, k_w, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e, n_w // 128, k_w // 128, device="cuda", generator=g) * 1e-3 + 1e-3
    qa, sa = quantize_1x128(torch.randn(m, n_w, device="cuda", generator=g).bfloat16())
    flops = 2 * m * n_w * k_w
    first = None
    for lag in (1, 2, 3):
        def call(lag=lag):
            return grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.bfloat16, settings={"LAG": lag})
        out = call()
        first = out if first is None else first
        ms = triton.testing.do_bench(call, warmup=10, rep=60)
        print(f"{name} LAG={lag}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s, same as LAG=1: {torch.equal(out, first)}")


run("gate_up_t", 2 * inter, d)
run("down_t", d, inter)

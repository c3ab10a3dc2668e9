"""The Gluon FP8 grouped GEMM's input gradient with one transposing warpgroup (the producer) against two
(``SPLIT``: a second warpgroup transposes the odd steps; 216 registers a math warpgroup), at the MoE shapes (256
experts top-6, 16k tokens, D 4096, I 2048) on prequantized operands, and on the GPU tests' edge cases; each
output against the one-transposer kernel's bit for bit (the math is the same). Run on an H200:
PYTHONPATH=. python lab/probes/fp8_gluon_split.py"""

import torch
import triton

from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from csattn.ops.moe import route_plan

SPLIT = {"SPLIT": True, "MATH_REGS": 216, "PRODUCER_REGS": 40}
g = torch.Generator(device="cuda").manual_seed(0)


def operands(e, n_w, k_w, offs, m):
    q = (torch.randn(e, n_w, k_w, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e, n_w // 128, k_w // 128, device="cuda", generator=g) * 1e-3 + 1e-3
    qa, sa = quantize_1x128(torch.randn(m, n_w, device="cuda", generator=g).bfloat16())
    return qa, sa, q, s


def edge_cases():
    for e, n, k, most in ((16, 384, 640, 300), (4, 256, 2048, 700), (3, 128, 256, 0), (5, 640, 128, 500)):
        counts = torch.randint(0, most + 1, (e,), generator=g, device="cuda")
        counts[0] = 0
        offs = counts.cumsum(0).to(torch.int32)
        m = int(offs[-1]) + 77
        qa, sa, q, s = operands(e, n, k, offs, m)
        one = grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32)
        two = grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32, settings=SPLIT)
        print(f"edge e={e} n={n} k={k}: split same bits {torch.equal(one, two)}")


def timed(name, n_w, k_w):
    tokens, e, k = 16384, 256, 6
    ids = torch.topk(torch.randn(tokens, e, device="cuda", generator=g), k, dim=-1).indices
    offs = route_plan(ids, e).offs
    qa, sa, q, s = operands(e, n_w, k_w, offs, tokens * k)
    flops = 2 * tokens * k * n_w * k_w
    outs = []
    for label, cfg in (("one transposer", None), ("split", SPLIT)):
        def call(cfg=cfg):
            return grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.bfloat16, settings=cfg)
        outs.append(call())
        ms = triton.testing.do_bench(call, warmup=10, rep=60)
        print(f"{name} {label}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s")
    print(f"{name} split same bits {torch.equal(outs[0], outs[1])}")


edge_cases()
timed("gate_up_t", 4096, 4096)
timed("down_t", 4096, 2048)

"""The Gluon FP8 kernel's input gradient at the MoE shapes (256 experts top-6, 16k tokens, D 4096, I 2048) with the
producer transposing each weight tile into a second buffer (the default: 4 stages of 48 KB) and over itself
(``INPLACE``, ``csattn.ops.fp8.gluon.inplace_settings()``: 6 stages of 32 KB, so the copies run 5 steps ahead of the
math instead of 3; also 7), at LAG 2 and 3, beside the forward GEMM and bf16 ``grouped_mm``; each INPLACE output
against the default's (fp32 outputs: the same products in the same order, so equal bit for bit); then the
frozen-expert MoE (forward + input gradient) with bf16 experts and FP8 experts both ways.

Why: the transposing input gradient ran 413-495 TFLOP/s against the forward's 700-786; a second transposing
warpgroup did not help (the transposition's issue rate is not the limit) and the lag mattered (316 / 458 / 445 at LAG
1 / 2 / 3): the copies' latency is what the 4-stage ring cannot hide. Run on an H200:
python -m lab.probes.fp8_gluon_inplace"""

from functools import partial
from unittest import mock

import torch
import triton

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.providers.fp8 import GROUPED, _moe_case, _quantized, _routed
from csattn.ops.fp8 import dequantize, quantize_1x128

# 7 stages of 32 KB also fit (224 KB) where LoRA's term is not in the kernel (its buffers take 16 KB more)
VARIANTS = {"INPLACE (6 stages, LAG 2)": fp8_gluon.inplace_settings(),
            "INPLACE (6 stages, LAG 3)": {**fp8_gluon.inplace_settings(), "LAG": 3},
            "INPLACE (7 stages, LAG 3)": {**fp8_gluon.inplace_settings(), "STAGES": 7, "LAG": 3}}


def gemms() -> None:
    dev = torch.device("cuda")
    ids, _, plan, e, k, gen = _routed(dict(GROUPED), dev)
    m, d, inter = ids.numel(), GROUPED["hidden"], GROUPED["inter"]
    for name, n_w, k_w in (("gate_up", 2 * inter, d), ("down", d, inter)):
        q, s = _quantized((e, n_w, k_w), dev, gen)
        dy = torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qa, sa = quantize_1x128(dy)
        x = torch.randn(m, k_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qx, sx = quantize_1x128(x)
        wb = torch.stack([dequantize(q[i], s[i], torch.bfloat16) for i in range(e)])
        mm = fp8_gluon.grouped_mm_gluon
        base = mm(qa, sa, q, s, plan.offs, True, out_dtype=torch.float32)
        for way, settings in VARIANTS.items():
            got = mm(qa, sa, q, s, plan.offs, True, out_dtype=torch.float32, settings=settings)
            torch.cuda.synchronize()
            print(f"{name:8s} {way} vs transposing into a second buffer: equal {torch.equal(got, base)}, "
                  f"largest difference {float((got - base).abs().max()):.3e}", flush=True)
        ways = {
            "fwd (reference)": partial(mm, qx, sx, q, s, plan.offs, False),
            "input grad, second buffer": partial(mm, qa, sa, q, s, plan.offs, True),
            **{f"input grad, {way}": partial(mm, qa, sa, q, s, plan.offs, True, settings=settings)
               for way, settings in VARIANTS.items()},
            "input grad, bf16 grouped_mm": partial(torch.nn.functional.grouped_mm, dy, wb, offs=plan.offs),
        }
        for way, call in ways.items():
            ms = triton.testing.do_bench(call, warmup=10, rep=60)
            print(f"{name:8s} {way:36s} {ms:7.3f} ms {2 * m * n_w * k_w / ms / 1e9:6.1f} TFLOP/s", flush=True)


def moe(settings: dict | None, compute: str) -> float:
    """The frozen-expert MoE (the benchmark's ``moe_frozen`` case) forward + input gradient, ms; ``settings`` over
    the input gradient's launch settings."""
    case = _moe_case(dict(GROUPED), torch.device("cuda"), torch.bfloat16, compute)
    out = case.forward()[0]
    dout = torch.randn_like(out)

    def step():
        return torch.autograd.grad(case.forward()[0], case.leaves, dout)

    launch = fp8_gluon.launch_settings
    # a lab switch for this comparison: the op's kernel calls take the given form of the input gradient
    patched = (lambda trans: {**launch(trans), **(settings if trans else {})}) if settings else launch
    with mock.patch.object(fp8_gluon, "launch_settings", patched):
        return triton.testing.do_bench(step, warmup=10, rep=60)


def main() -> None:
    gemms()
    bf16 = moe(None, "bf16")
    print(f"frozen MoE fwd + input grad: bf16 experts {bf16:.2f} ms", flush=True)
    for way, settings in {"second buffer": None, **VARIANTS}.items():
        ms = moe(settings, "fp8")
        print(f"frozen MoE fwd + input grad: FP8, {way}: {ms:.2f} ms ({bf16 / ms:.2f}x bf16)", flush=True)


if __name__ == "__main__":
    main()

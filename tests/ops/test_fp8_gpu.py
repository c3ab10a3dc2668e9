"""The FP8 ops on the GPU at real shapes: the fused quantizer bit for bit against its reference; the grouped
kernel (FP8 and W8A16, forward and transposed) and the FP8 linear (forward and every input-gradient route)
against fp64 math on the same quantized operands (fp32 summation apart); frozen FP8 experts in moe_experts
against the dequantized bf16 experts, within the error the bf16 path itself has against fp64."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.fp8 import (
    FP8_DTYPE,
    dequantize,
    fp8_grouped_mm_quantized,
    fp8_linear,
    fp8_linear_quantized,
    quantize_1x128,
    quantize_1x128_ref,
)
from csattn.ops.fp8.grouped import gluon_fits
from csattn.ops.fp8.linear import DGRADS, input_grad
from csattn.ops.fp8.triton import grouped_mm_triton
from csattn.ops.moe import moe_experts
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu
LIMIT = 10.0


def _weight(shape, g, fan_in):
    *lead, n, k = shape
    q = (torch.randn(*shape, generator=g, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE)
    s = (torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g, device="cuda") + 0.5) * fan_in ** -0.5 / 100
    return q, s


def test_quantize_bitwise_at_scale():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 4096, generator=g, device="cuda") * torch.logspace(-4, 4, 4096, device="cuda")[:, None]
    x[7, :128] = 0
    for xd in (x.bfloat16(), x):
        q, s = quantize_1x128(xd, scale_t=True)
        qr, sr = quantize_1x128_ref(xd)
        print(f"{xd.dtype}: q bytes differing {(q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()}, "
              f"scales differing {(s != sr).sum().item()}")
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("mode", ["fp8", "w8a16"])
def test_grouped_kernel_vs_same_operands(trans, mode):
    g = torch.Generator(device="cuda").manual_seed(1)
    e, n, k = 16, 1024, 512
    counts = torch.randint(0, 300, (e,), generator=g, device="cuda")
    counts[3] = 0
    offs = counts.cumsum(0).to(torch.int32)
    q, s = _weight((e, n, k), g, n if trans else k)
    m = int(offs[-1]) + 5
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    out = torch.full((m, k if trans else n), float("nan"), device="cuda", dtype=torch.bfloat16)
    if mode == "fp8":
        qa, sa = quantize_1x128(a)
        grouped_mm_triton(qa, sa, q, s, offs, trans, out=out)
        out32 = grouped_mm_triton(qa, sa, q, s, offs, trans, out_dtype=torch.float32)
    else:
        grouped_mm_triton(a, None, q, s, offs, trans, out=out)
        out32 = grouped_mm_triton(a, None, q, s, offs, trans, out_dtype=torch.float32)
    # the very operands the kernel multiplied (the quantizer has its own test)
    ad = qa.double() * sa.double().repeat_interleave(128, dim=-1)[:, :a.shape[1]] if mode == "fp8" else a
    same = fp8_grouped_mm_quantized(ad, q, s, offs, trans, quantize_a=False)
    assert torch.isfinite(out).all() and (out[int(offs[-1]):] == 0).all()
    # Hopper's FP8 MMA keeps about 14 bits in its accumulator over the 128-deep block before the promotion
    # (DeepSeek-V3 report, 3.3.2): within 2^-12 against exact sums of the same operands; bf16 MMA: fp32's
    assert rel_err(out32, same) < (2.0 ** -12 if mode == "fp8" else 1e-6), rel_err(out32, same)
    assert rel_err(out, same) < 4e-3  # the bf16 output rounding
    exact = fp8_grouped_mm_quantized(a, q, s, offs, trans, quantize_a=False)
    print(f"{mode} trans={trans}: vs same operands {rel_err(out32, same):.2e}, "
          f"vs unquantized {rel_err(out32, exact):.2e}")


# (experts, N, K, rows per expert below): 5 / 3 contraction steps (the 4-step rounds and the remainder), empty
# experts, more tiles than programs (the persistent loop); 16 / 2 steps; every row past offs[-1]
GLUON_CASES = {"ragged": (16, 384, 640, 300), "deep": (4, 256, 2048, 700), "all_tail": (3, 128, 256, 0)}


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_grouped_vs_same_operands(case, trans):
    e, n, k, most = GLUON_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(4)
    q, s = _weight((e, n, k), g, n if trans else k)
    a = torch.randn(8, n if trans else k, device="cuda")
    if not gluon_fits(a, q):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    counts = torch.randint(0, most + 1, (e,), generator=g, device="cuda")
    counts[0] = counts[e // 2] = 0
    offs = counts.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 77  # rows past offs[-1]; M not a multiple of the 128-row tile
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    qa, sa = quantize_1x128(a)
    out = torch.full((m, k if trans else n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_gluon(qa, sa, q, s, offs, trans, out=out)
    out32 = torch.full(out.shape, float("nan"), device="cuda")
    grouped_mm_gluon(qa, sa, q, s, offs, trans, out=out32)
    again = grouped_mm_gluon(qa, sa, q, s, offs, trans, out_dtype=torch.float32)
    ad = qa.double() * sa.double().repeat_interleave(128, dim=-1)
    same = fp8_grouped_mm_quantized(ad, q, s, offs, trans, quantize_a=False)
    assert torch.isfinite(out).all() and (out[int(offs[-1]):] == 0).all()
    assert torch.equal(out32, again)  # no race: the same bits twice
    err = rel_err(out32, same) if most else float(out32.abs().max())
    print(f"gluon {case} trans={trans}: vs same operands {err:.2e}")
    # Hopper's FP8 MMA keeps about 14 bits in its accumulator over the 128-deep block (as the Triton kernel)
    assert err < 2.0 ** -12, err
    if most:
        assert rel_err(out, same) < 4e-3


# every (K, N) of the tiny GPU models and the block counts around cuBLAS's limit (SCALED_MM_MIN_K): the forward and
# the input gradient, whose contraction is N
@pytest.mark.parametrize("k,n", [(128, 256), (256, 256), (256, 512), (384, 2048), (512, 256), (2048, 128), (256, 128)])
def test_fp8_linear_small_shapes(k, n):
    g = torch.Generator(device="cuda").manual_seed(5)
    m = 256
    q, s = _weight((n, k), g, k)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    out = fp8_linear(x, q, s, "fp8")
    (dx,) = torch.autograd.grad(out, x, dy)
    want = fp8_linear_quantized(x.detach(), q, s)
    dwant = fp8_linear_quantized(dy, q.t().contiguous(), s.t().contiguous())
    print(f"k {k} n {n}: out {rel_err(out, want):.2e} dx {rel_err(dx, dwant):.2e}")
    assert rel_err(out, want) < 4e-3 and rel_err(dx, dwant) < 4e-3, (rel_err(out, want), rel_err(dx, dwant))


@pytest.mark.parametrize("m", [4096, 1000])
@pytest.mark.parametrize("compute", ["fp8", "w8a16"])
def test_fp8_linear_vs_same_operands(m, compute):
    g = torch.Generator(device="cuda").manual_seed(2)
    n, k = 2048, 4096
    q, s = _weight((n, k), g, k)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    out = fp8_linear(x, q, s, compute)
    (dx,) = torch.autograd.grad(out, x, dy)
    w = dequantize(q, s, torch.float64)
    want = fp8_linear_quantized(x.detach(), q, s) if compute == "fp8" else x.detach().double() @ w.T
    assert rel_err(out, want) < 4e-3, rel_err(out, want)
    dwant = fp8_linear_quantized(dy, q.t().contiguous(), s.t().contiguous()) if compute == "fp8" else dy.double() @ w
    assert rel_err(dx, dwant) < 4e-3, rel_err(dx, dwant)
    for method in DGRADS:
        got = input_grad(dy, q, s, compute, method)
        tol = 4e-3 if method != "bf16" else 1e-2  # bf16: dY unquantized, W rounded to bf16 (exact for e4m3 * 2^j)
        print(f"{compute} m={m} dgrad {method}: {rel_err(got, dwant):.2e}")
        assert rel_err(got, dwant if method != "bf16" else dy.double() @ w) < tol


def test_moe_fp8_experts_vs_bf16():
    g = torch.Generator(device="cuda").manual_seed(3)
    t, e, k, d, inter = 2048, 32, 6, 1024, 512
    gu = _weight((e, 2 * inter, d), g, d)
    dn = _weight((e, d, inter), g, inter)
    x = torch.randn(t, d, generator=g, device="cuda")
    top = torch.topk(torch.randn(t, e, generator=g, device="cuda"), k, dim=-1)
    ids, w = top.indices, torch.softmax(top.values, -1)
    dout = torch.randn(t, d, generator=g, device="cuda")
    wgu, wdn = dequantize(*gu, torch.float64), dequantize(*dn, torch.float64)

    def run(dtype, weights, scales, backend="auto", compute="fp8"):
        xx, ww = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        out = moe_experts(xx, ids, ww, *(t if t.dtype == FP8_DTYPE else t.to(dtype) for t in weights), LIMIT,
                          backend, gate_up_scale=scales[0], down_scale=scales[1], fp8_compute=compute)
        return [out, *torch.autograd.grad(out, (xx, ww), dout.to(dtype))]

    exact = run(torch.float64, (wgu, wdn), (None, None), "reference")
    bf16 = run(torch.bfloat16, (wgu, wdn), (None, None))
    for compute in ("fp8", "w8a16"):
        got = run(torch.bfloat16, (gu[0], dn[0]), (gu[1], dn[1]), compute=compute)
        for name, a, b, c in zip(("out", "dx", "dweights"), got, bf16, exact):
            ea, eb = rel_err(a, c), rel_err(b, c)
            print(f"moe {compute} {name}: {ea:.2e} (bf16 experts {eb:.2e})")
            # FP8: the two GEMM inputs of each pass quantized in series, each moved by an RMS of at most
            # 2^-4 / sqrt(3) of itself (e4m3 rounding): 2 x that bounds the relative error; W8A16: the bf16 path's
            assert ea <= (2 * 2.0 ** -4 / 3 ** 0.5 if compute == "fp8" else 1.5 * eb + 1e-3), (name, ea, eb)

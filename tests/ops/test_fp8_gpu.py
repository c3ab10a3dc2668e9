"""The FP8 ops on the GPU at real shapes: the fused quantizer bit for bit against its reference; the grouped
kernel (FP8 and W8A16, forward and transposed) and the FP8 linear (forward and every input-gradient route)
against fp64 math on the same quantized operands (fp32 summation apart); frozen FP8 experts in moe_experts
against the dequantized bf16 experts, within the error the bf16 path itself has against fp64, and bit for bit the
same step with the GEMM inputs quantized in separate passes (the op quantizes them where they are made)."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    LowRank,
    dequantize,
    fp8_grouped_mm,
    fp8_grouped_mm_quantized,
    fp8_linear,
    fp8_linear_quantized,
    low_rank_ref,
    quantize_1x128,
    quantize_1x128_ref,
    quantize_1x128_rows,
    takes_fp8_rows,
)
from csattn.ops.fp8.grouped import gluon_fits
from csattn.ops.fp8.linear import DGRADS, input_grad
from csattn.ops.fp8.triton import grouped_mm_triton
from csattn.ops.moe import ExpertLora, moe_experts
from tests.helpers import in_own_process, rel_err

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
        # into expert order in the same pass (the MoE's rows): the rows above gathered
        dest = torch.randperm(6 * 4096, generator=g, device="cuda").view(4096, 6)
        token = torch.empty_like(dest.view(-1))
        token[dest.view(-1)] = torch.arange(4096, device="cuda").repeat_interleave(6)
        rows = quantize_1x128_rows(xd, dest)
        assert torch.equal(rows.q.view(torch.uint8), qr.view(torch.uint8)[token]) and torch.equal(rows.s, sr[token])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_quotients_are_divisions(dtype):
    """The quantizer's quotients (one IEEE reciprocal a row, an FMA correction: ``triton._quotient``) against the
    reference's divisions, bit for bit: 32768 rows, each of random mantissas and signs over the 14 binades below a
    planted maximum of random mantissa, at exponents from 2^-140 to 2^120 (the e4m3 codes' range and past it, tiny
    scales: subnormal codes, zeros, signed zeros)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    rows, cols = 32768, 256
    top = torch.randint(-140, 121, (rows, 1), generator=g, device="cuda").double()
    mant = 1 + torch.rand(rows, cols, generator=g, device="cuda", dtype=torch.float64)
    sign = torch.randint(0, 2, (rows, cols), generator=g, device="cuda").double() * 2 - 1
    x = sign * mant * torch.exp2(top - torch.randint(0, 15, (rows, cols), generator=g, device="cuda").double())
    x[:, ::128] = torch.exp2(top + 1) * (1 + torch.rand(rows, 1, generator=g, device="cuda", dtype=torch.float64))
    x[::7, 5] = -0.0
    x = x.to(dtype)
    q, s = quantize_1x128(x)
    qr, sr = quantize_1x128_ref(x)
    differ = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
    print(f"{dtype}: codes differing {differ} of {q.numel()}, nonzero codes {(qr.float() != 0).sum().item()}")
    assert differ == 0 and torch.equal(s, sr)


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


@pytest.mark.parametrize("way", ["fwd", "trans"])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_grouped_vs_same_operands(case, way):
    """Both directions against fp64 on the same quantized operands (the input gradient with the producer
    transposing the weight tile)."""
    _gluon_grouped_case(case, way)


def _group_counts(e: int, most: int, g: torch.Generator) -> torch.Tensor:
    """Rows of ``e`` groups, at most ``most`` each: two empty; where ``most`` allows, one whose last tile has 40 rows
    (its lower math warpgroup's rows all past the group's end) and one whose last tile has 100."""
    counts = torch.randint(0, most + 1, (e,), generator=g, device="cuda")
    counts[0] = counts[e // 2] = 0
    counts[1], counts[2] = min(most, 128 + 40), min(most, 100)
    return counts


def _gluon_grouped_case(case: str, way: str) -> None:
    trans = way != "fwd"
    e, n, k, most = GLUON_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(4)
    q, s = _weight((e, n, k), g, n if trans else k)
    a = torch.randn(8, n if trans else k, device="cuda")
    if not gluon_fits(a, q):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    counts = _group_counts(e, most, g)
    offs = counts.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 77  # rows past offs[-1]; M not a multiple of the 128-row tile
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    qa, sa = quantize_1x128(a)
    out = torch.full((m, k if trans else n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_gluon(qa, sa, q, s, offs, trans, out=out)
    out32 = torch.full(out.shape, float("nan"), device="cuda")
    grouped_mm_gluon(qa, sa, q, s, offs, trans, out=out32)
    again = grouped_mm_gluon(qa, sa, q, s, offs, trans, out_dtype=torch.float32)
    # the scales in the transposed layout (the kernel reads them by strides): the same bits
    sa_t = quantize_1x128(a, scale_t=True)[1]
    assert sa_t.stride(0) == 1 and torch.equal(sa_t, sa)
    assert torch.equal(grouped_mm_gluon(qa, sa_t, q, s, offs, trans, out_dtype=torch.float32), again)
    ad = qa.double() * sa.double().repeat_interleave(128, dim=-1)
    same = fp8_grouped_mm_quantized(ad, q, s, offs, trans, quantize_a=False)
    assert torch.isfinite(out).all() and (out[int(offs[-1]):] == 0).all()
    assert torch.equal(out32, again)  # no race: the same bits twice
    err = rel_err(out32, same) if most else float(out32.abs().max())
    print(f"gluon {case} {way}: vs same operands {err:.2e}")
    # Hopper's FP8 MMA keeps about 14 bits in its accumulator over the 128-deep block (as the Triton kernel)
    assert err < 2.0 ** -12, err
    if most:
        assert rel_err(out, same) < 4e-3


def _same_bits_case(case: tuple[int, int, int, int], trans: bool, low_rank: bool, seed: int) -> tuple:
    """Operands for two ways of the Gluon kernel compared bit for bit (skips off sm_90): ``case`` ``(E, N, K, most
    rows a group)``, weights ``[E, N, K]``, groups as :func:`_group_counts`, 77 rows past ``offs[-1]``, the bf16
    activation ``a`` (``[M, N]`` with ``trans``, else ``[M, K]``) and its 1x128 quantization, LoRA's term ``(v, w,
    0.75)`` at the kernel's rank or None. Returns ``(q, s, offs, a, qa, sa, lr, generator)``."""
    e, n, k, most = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, s = _weight((e, n, k), g, n if trans else k)
    if not gluon_fits(torch.empty(1, device="cuda"), q):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from csattn.ops.fp8.gluon import RANK

    offs = _group_counts(e, most, g).cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 77
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    lr = None
    if low_rank:
        lr = (torch.randn(m, RANK, generator=g, device="cuda").bfloat16(),
              (torch.randn(e, k if trans else n, RANK, generator=g, device="cuda") * 0.3).bfloat16(), 0.75)
    return q, s, offs, a, *quantize_1x128(a), lr, g


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_input_grad_on_copy_equals_transposing(case, low_rank):
    """The input gradient on the weights' K-major copy (the forward's kernel on ``transposed_weight``) equals the
    in-kernel transposition bit for bit, without and with LoRA's term: the same operand tiles in shared memory, the
    same products in the same order. The copy's codes are the transpose bit for bit at the slice's expert shape."""
    from csattn.ops.fp8.gluon import grouped_mm_gluon
    from csattn.ops.fp8.grouped import transposed_weight

    q, s, offs, _, qa, sa, lr, g = _same_bits_case(GLUON_CASES[case], True, low_rank, 6)
    wt, st = transposed_weight(q, s)
    assert torch.equal(wt.view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
    out = torch.full((qa.shape[0], q.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_gluon(qa, sa, wt, st, offs, False, out=out, low_rank=lr)
    assert torch.equal(out, grouped_mm_gluon(qa, sa, q, s, offs, True, low_rank=lr))
    big = torch.randint(0, 256, (64, 2048, 4096), generator=g, device="cuda", dtype=torch.uint8)
    assert torch.equal(transposed_weight(big.view(FP8_DTYPE), s.new_ones(64, 16, 32))[0].view(torch.uint8),
                       big.transpose(1, 2))


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_split_transposition_equals_one_transposer(case, low_rank, request):
    """The input gradient with its transposition split over two warpgroups (``SPLIT``, the default) equals the one
    transposer's bit for bit, without and with LoRA's term (the same K-major tiles, the same products); rows past
    ``offs[-1]`` zero. In its own process: a new kernel's first runs."""
    if not in_own_process(request):
        return
    from csattn.ops.fp8.gluon import grouped_mm_gluon, launch_settings

    q, s, offs, _, qa, sa, lr, _ = _same_bits_case(GLUON_CASES[case], True, low_rank, 7)
    out = torch.full((qa.shape[0], q.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_gluon(qa, sa, q, s, offs, True, out=out, low_rank=lr, settings=launch_settings(True, split=True))
    one = grouped_mm_gluon(qa, sa, q, s, offs, True, low_rank=lr, settings=launch_settings(True, split=False))
    assert torch.equal(out, one)
    assert (out[int(offs[-1]):] == 0).all()


@pytest.mark.parametrize("form", ["plain", "paired", "permuted"])
@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_split_forms_equal_the_default(case, low_rank, form, request):
    """The default split transposition (``PAIRED``: two steps a fence; ``PERMUTED``: the copied and transposed tiles'
    rows permuted, the product's columns put back in the epilogue, LoRA's ``w`` copied permuted alike) equals its
    forms with either or both off bit for bit, without and with LoRA's term; rows past ``offs[-1]`` zero. In its own
    process: a new kernel's first runs."""
    if not in_own_process(request):
        return
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    settings = {"PAIRED": form == "paired", "PERMUTED": form == "permuted"}
    q, s, offs, _, qa, sa, lr, _ = _same_bits_case(GLUON_CASES[case], True, low_rank, 8)
    out = torch.full((qa.shape[0], q.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_mm_gluon(qa, sa, q, s, offs, True, out=out, low_rank=lr, settings=settings)
    assert torch.equal(out, grouped_mm_gluon(qa, sa, q, s, offs, True, low_rank=lr))
    assert (out[int(offs[-1]):] == 0).all()


# (experts, N, K, rows per expert below) for the [64, 256] tiles (N a multiple of 256): 5 contraction steps (a round
# and the steps past it) with empty experts and last tiles of 40 / 100 rows, 16 steps, every row past offs[-1]
WIDE_CASES = {"ragged": (16, 512, 640, 300), "deep": (4, 256, 2048, 700), "all_tail": (3, 256, 256, 0)}


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_gluon_wide_forward_equals_the_kernel(case, low_rank, monkeypatch, request):
    """The forward over ``[64, 256]`` tiles (``gluon_wide``) equals the ``[128, 128]`` kernel bit for bit (each
    output's products, scales and additions in the same order), without and with LoRA's term; rows past
    ``offs[-1]`` zero; the op takes it where ``takes_wide`` holds. In its own process: a new kernel's first runs (a
    fault ends the process's CUDA context)."""
    if not in_own_process(request):
        return
    import csattn.ops.fp8.gluon_wide as fp8_wide
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    q, s, offs, a, qa, sa, lr, _ = _same_bits_case(WIDE_CASES[case], False, low_rank, 8)
    out = torch.full((a.shape[0], q.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    fp8_wide.grouped_mm_gluon_wide(qa, sa, q, s, offs, out=out, low_rank=lr)
    base = grouped_mm_gluon(qa, sa, q, s, offs, False, low_rank=lr)
    assert torch.equal(out, base) and (out[int(offs[-1]):] == 0).all()
    sa_t = quantize_1x128(a, scale_t=True)[1]  # the scales' transposed layout, read by strides: the same bits
    assert torch.equal(fp8_wide.grouped_mm_gluon_wide(qa, sa_t, q, s, offs, low_rank=lr), base)
    monkeypatch.setattr(fp8_wide, "WIDE_FORWARD", True)
    assert torch.equal(fp8_grouped_mm(a, q, s, offs, low_rank=None if lr is None else LowRank(*lr)), base)


def test_fp8_grouped_input_grad_takes_the_copy_from_its_rows():
    """With ``COPY_ROWS_PER_EXPERT`` rows an expert the op's input gradient runs on the K-major copy: the in-kernel
    transposition's output bit for bit, LoRA's term included."""
    from csattn.ops.fp8.grouped import COPY_ROWS_PER_EXPERT, input_grad_copies

    e, n, k = 3, 256, 384
    g = torch.Generator(device="cuda").manual_seed(7)
    q, s = _weight((e, n, k), g, n)
    if not gluon_fits(torch.empty(1, device="cuda"), q):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    counts = torch.tensor([COPY_ROWS_PER_EXPERT + 300, COPY_ROWS_PER_EXPERT - 200, COPY_ROWS_PER_EXPERT + 41],
                          device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 5
    assert input_grad_copies(m, e)
    dy = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    qa, sa = quantize_1x128(dy)
    v = torch.randn(m, 16, generator=g, device="cuda").bfloat16()
    w = (torch.randn(e, k, 16, generator=g, device="cuda") * 0.3).bfloat16()
    assert torch.equal(fp8_grouped_mm(dy, q, s, offs, trans=True), grouped_mm_gluon(qa, sa, q, s, offs, True))
    assert torch.equal(fp8_grouped_mm(dy, q, s, offs, trans=True, low_rank=LowRank(v, w, 0.75)),
                       grouped_mm_gluon(qa, sa, q, s, offs, True, low_rank=(v, w, 0.75)))


@pytest.mark.parametrize("rank", [16, 8, 32])
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("case", ["ragged", "all_tail"])
def test_gluon_low_rank_term_vs_same_operands(case, trans, rank):
    """LoRA's term in the kernel's epilogue (rank 16; 8 padded to it; 32 added after the kernel): the product plus
    ``scale * v w_e^T`` against fp64 on the same operands; rows past ``offs[-1]`` zero; the same bits twice."""
    _low_rank_case(case, trans, rank)


def _low_rank_case(case: str, trans: bool, rank: int) -> None:
    e, n, k, most = GLUON_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(5)
    q, s = _weight((e, n, k), g, n if trans else k)
    if not gluon_fits(torch.empty(1, device="cuda"), q):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    n_out = k if trans else n
    counts = _group_counts(e, most, g)
    offs = counts.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + 77
    a = torch.randn(m, n if trans else k, generator=g, device="cuda").bfloat16()
    v = torch.randn(m, rank, generator=g, device="cuda").bfloat16()
    w = (torch.randn(e, n_out, rank, generator=g, device="cuda") * 0.3).bfloat16()
    lr = LowRank(v, w, 0.75)
    same = fp8_grouped_mm_quantized(a, q, s, offs, trans) + 0.75 * low_rank_ref(v.double(), w.double(), offs)
    qa, sa = quantize_1x128(a)
    from csattn.ops.fp8.gluon import RANK, grouped_mm_gluon

    # the op's route, and the kernel's own epilogue (whether or not the op routes the term there)
    ways = {"op": lambda out: fp8_grouped_mm(a, q, s, offs, trans, low_rank=lr)}
    if rank == RANK:
        ways["kernel"] = lambda out: grouped_mm_gluon(qa, sa, q, s, offs, trans, out=out, low_rank=lr)
    for way, run in ways.items():
        out = torch.full((m, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = run(out)
        assert torch.isfinite(out).all() and (out[int(offs[-1]):] == 0).all(), way
        assert torch.equal(out, run(torch.empty_like(out))), way  # the same bits twice
        if most:
            err = rel_err(out, same)
            print(f"gluon low rank {case} trans={trans} r={rank} {way}: {err:.2e}")
            assert err < 4e-3, (way, err)  # bf16's rounding of the output (as the kernel without the term)
    if rank == RANK:  # B = 0 (LoRA at step 0): the kernel's output without the term, bit for bit
        zero = grouped_mm_gluon(qa, sa, q, s, offs, trans, low_rank=LowRank(v, torch.zeros_like(w), 0.75))
        assert torch.equal(zero, grouped_mm_gluon(qa, sa, q, s, offs, trans))


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


@pytest.mark.parametrize("trans", [False, True])
def test_fp8_rows_are_the_rows_quantized_inside(trans):
    g = torch.Generator(device="cuda").manual_seed(6)
    e, n, k = 8, 384, 256
    q, s = _weight((e, n, k), g, n if trans else k)
    if not takes_fp8_rows(torch.bfloat16, torch.device("cuda"), q, "fp8", trans):
        pytest.skip("no FP8 kernel takes quantized rows in this direction on this GPU")
    counts = torch.randint(0, 100, (e,), generator=g, device="cuda")
    counts[2] = 0
    offs = counts.cumsum(0).to(torch.int32)
    a = torch.randn(int(offs[-1]) + 9, n if trans else k, generator=g, device="cuda").bfloat16()
    got = fp8_grouped_mm(Fp8Rows(*quantize_1x128(a)), q, s, offs, trans, out_dtype=torch.bfloat16)
    assert torch.equal(got, fp8_grouped_mm(a, q, s, offs, trans))


def _composed_moe(x, w, ids, dout, gu, dn, e, lora):
    """The frozen-FP8 MoE step from public ops, each FP8 GEMM quantizing its bf16 input itself (the separate
    passes), the LoRA terms handed to the GEMMs as the op hands them (``low_rank``): (out, dx, dweights)."""
    from csattn.ops.moe import route_plan
    from csattn.ops.moe.lora_triton import rank_in_triton
    from csattn.ops.moe.triton import gather_sum_triton, swiglu_bwd_triton, swiglu_fwd_triton

    def term(v, i, into):  # LoRA pair i on a GEMM from v (the forward) or from its output gradient
        if not lora:
            return None
        a, b, scale = lora[i]
        # the op's rank-r kernel, here on the gathered rows (the op reads them through the index: the same tiles)
        return LowRank(rank_in_triton(v, a.transpose(-2, -1) if into else b, offs),
                       b if into else a.transpose(-2, -1), scale)

    k = ids.shape[-1]
    plan = route_plan(ids, e)
    offs = plan.offs
    ws = w.reshape(-1).index_select(0, plan.order)
    xp = x.index_select(0, plan.token)
    gup = fp8_grouped_mm(xp, *gu, offs, low_rank=term(xp, 0, True))
    h = swiglu_fwd_triton(gup, ws, LIMIT)
    y = fp8_grouped_mm(h, *dn, offs, low_rank=term(h, 1, True))
    out = gather_sum_triton(y, plan.inv, k)
    dy = dout.index_select(0, plan.token)
    dh = fp8_grouped_mm(dy, *dn, offs, trans=True, low_rank=term(dy, 1, False))
    # with LoRA the op's SwiGLU backward writes all three (dgu, its quantized tiles, h for LoRA's a gradient): run
    # that variant here too, since another variant of the kernel may sum dw's fp32 products in another order (on an
    # H100 at e80df6b dweights differed by 3.6e-09 with the two-output variant; equal with this one at dd6a62d),
    # which is not what this test is about. The GEMM below still quantizes the bf16 dgu itself.
    quantized = Fp8Rows.empty(*gup.shape, gup.device) if lora else None
    dgu, _, dw = swiglu_bwd_triton(gup, ws, dh, LIMIT, fp8_out=quantized)
    dxp = fp8_grouped_mm(dgu, *gu, offs, trans=True, low_rank=term(dgu, 0, False))
    return out, gather_sum_triton(dxp, plan.inv, k), dw.index_select(0, plan.inv).view(-1, k).to(w.dtype)


@pytest.mark.parametrize("with_lora", [False, True])
def test_moe_fp8_quantizes_where_made_bitwise(with_lora, monkeypatch):
    """The MoE with frozen FP8 experts hands its GEMMs rows quantized where they are made (x and dout before their
    gathers, h and dgu by the SwiGLU kernels): bit for bit what quantizing in separate passes gives."""
    import csattn.ops.moe.grouped as moe_grouped

    g = torch.Generator(device="cuda").manual_seed(7)
    t, e, k, d, inter, r = 512, 64, 6, 512, 256, 16
    gu, dn = _weight((e, 2 * inter, d), g, d), _weight((e, d, inter), g, inter)
    cuda = torch.device("cuda")
    if not takes_fp8_rows(torch.bfloat16, cuda, gu[0], "fp8", False):
        pytest.skip("no FP8 tensor cores (sm_89+)")
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    top = torch.topk(torch.randn(t, e, generator=g, device="cuda"), k, dim=-1)
    ids, w = top.indices, torch.softmax(top.values, -1).bfloat16()
    dout = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    lora = None
    if with_lora:
        f = [torch.randn(shape, generator=g, device="cuda").bfloat16() * 0.05
             for shape in ((e, r, d), (e, 2 * inter, r), (e, r, inter), (e, d, r))]
        lora = (ExpertLora(f[0], f[1], 2.0), ExpertLora(f[2], f[3], 0.5))
    given, plain = [], moe_grouped.fp8_grouped_mm

    def spy(a, *args, **kwargs):  # which GEMM inputs come quantized
        given.append(isinstance(a, Fp8Rows))
        return plain(a, *args, **kwargs)

    monkeypatch.setattr(moe_grouped, "fp8_grouped_mm", spy)
    leaves = [v.detach().requires_grad_() for v in (x, w, *(lora[0][:2] + lora[1][:2] if lora else ()))]
    grouped = {} if lora is None else {
        "gate_up_lora": ExpertLora(leaves[2], leaves[3], 2.0), "down_lora": ExpertLora(leaves[4], leaves[5], 0.5)}
    out = moe_experts(leaves[0], ids, leaves[1], gu[0], dn[0], LIMIT, "triton", gate_up_scale=gu[1],
                      down_scale=dn[1], fp8_compute="fp8", **grouped)
    got = [out, *torch.autograd.grad(out, leaves[:2], dout)]
    # the forward's two GEMMs, and the input gradient's where the Gluon kernel takes them (dgu: I % 128 == 0)
    want_rows = [True, True, takes_fp8_rows(torch.bfloat16, cuda, dn[0], "fp8", True),
                 takes_fp8_rows(torch.bfloat16, cuda, gu[0], "fp8", True)]
    print(f"lora={with_lora}: quantized rows given to the four GEMMs: {given}")
    assert given == want_rows
    want = _composed_moe(x, w, ids, dout, gu, dn, e, lora)
    for name, a, b in zip(("out", "dx", "dweights"), got, want):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), (name, rel_err(a, b))

"""The FP8 ops (csattn.ops.fp8) on the CPU: the fused quantizer under Triton's interpreter bit for bit against its
reference; the references of the FP8 linear and grouped GEMM against fp64 math of the dequantized weights
(outputs and input gradients); the grouped kernel under the interpreter on tiny ragged shapes (empty experts,
one row, rows past the last group) against the same computation on the same quantized operands in fp64 (fp32
summation apart) and within the FP8 quantization bound of the exact product; frozen FP8 experts in moe_experts
against the dequantized fp64 experts (output, dx, dweights). The interpreter's bf16 dot is wrong (numpy has no
bf16), so the W8A16 mode runs here with fp16 activations."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from csattn.ops.backend import triton_version
from csattn.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    LowRank,
    dequantize,
    fp8_grouped_mm,
    fp8_grouped_mm_quantized,
    fp8_grouped_mm_ref,
    fp8_linear,
    fp8_linear_ref,
    quantize_1x128,
    quantize_1x128_ref,
)
from csattn.ops.fp8.triton import _quotient, grouped_mm_triton, quantize_1x128_triton, transpose_codes_triton
from csattn.ops.moe import ExpertLora, moe_experts

LIMIT = 10.0
EPS_E4M3 = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: rounding to nearest is within 2^-4 relative (normal range)


def _weight(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weight with block scales of several magnitudes (as a release's are)."""
    *lead, n, k = shape
    q = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4
    return q, s


def _activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Rows of varied magnitude, a zero tile, tiny values (e4m3 subnormals after scaling)."""
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[0, :min(k, 128)] = 0
    if m > 2:
        x[2, 1:] *= 1e-6
    return x


@pytest.mark.parametrize("m,k", [(7, 300), (1, 128), (33, 256)])
@pytest.mark.parametrize("scale_t", [False, True])
def test_quantize_kernel_bitwise(m, k, scale_t):
    x = _activations(m, k, torch.Generator().manual_seed(m + k))
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        q = torch.full((m, k), float("nan")).to(FP8_DTYPE)
        s = torch.full((-(-k // 128), m), float("nan")).t() if scale_t else torch.full((m, -(-k // 128)), float("nan"))
        quantize_1x128_triton(xd, scale_t, out=(q, s))
        qr, sr = quantize_1x128_ref(xd)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(s, sr)
    got_q, got_s = quantize_1x128(x, scale_t=scale_t)  # CPU: the reference, the layout asked for
    assert torch.equal(got_s, quantize_1x128_ref(x)[1])
    assert got_s.stride() == ((1, m) if scale_t else (got_s.shape[1], 1))


@triton.jit
def _quotient_kernel(v, s, out, BR: tl.constexpr, BC: tl.constexpr):
    at = tl.arange(0, BR)[:, None] * BC + tl.arange(0, BC)[None, :]
    tl.store(out + at, _quotient(tl.load(v + at), tl.load(s + tl.arange(0, BR))))


@pytest.mark.skipif(triton_version() < (3, 7), reason="Triton's interpreter rounds an FMA twice before 3.7")
@pytest.mark.parametrize("bf16", [False, True])
def test_quantizer_quotient_is_the_division(bf16, monkeypatch):
    """The kernels' quotient (one IEEE reciprocal a row and an FMA correction; tiny scales taken by 2^64) under the
    interpreter, against torch's IEEE division: the same fp32 bits wherever the quotient is normal, the same e4m3
    codes everywhere (signed zeros included), over scales from 2^-148 (subnormal) to 2^113."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3 + bf16)
    rows, cols = 64, 128
    top = torch.randint(-140, 121, (rows, 1), generator=g).double()
    amax = torch.exp2(top + 1) * (1 + torch.rand(rows, 1, generator=g, dtype=torch.float64))
    sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
    v = (torch.rand(rows, cols, generator=g, dtype=torch.float64) + 1) * sign * torch.exp2(
        top - torch.randint(0, 15, (rows, cols), generator=g).double())
    v[:, 0], v[::5, 7] = amax[:, 0], -0.0
    v = v.to(torch.bfloat16).float() if bf16 else v.float()
    amax = v.abs().amax(1)
    scale = torch.where(amax == 0, 1.0, amax / torch.tensor(FP8_MAX))  # the quantizer's: an IEEE division
    assert (scale > 0).all()
    got = torch.full_like(v, float("nan"))
    _quotient_kernel[(1,)](v, scale, got, BR=v.shape[0], BC=cols)
    want = v / scale[:, None]
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    assert torch.equal(got[normal], want[normal])
    codes = [q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8) for q in (got, want)]
    assert torch.equal(*codes)


def test_quantize_reference_guarantees():
    x = _activations(9, 384, torch.Generator().manual_seed(1)).double()
    q, s = quantize_1x128_ref(x)
    assert s[0, 0] == 1 and (q[0, :128].float() == 0).all()  # the zero tile: scale 1
    tiles = x.view(9, 3, 128)
    back = q.double().view(9, 3, 128) * s.double()[..., None]
    amax = tiles.abs().amax(-1)
    assert torch.allclose(back.abs().amax(-1), amax, rtol=1e-6)  # the tile maximum maps to 448 exactly
    normal = back.abs() >= 2.0 ** -6 * s.double()[..., None]
    err = (back - tiles).abs()
    assert (err[normal] <= EPS_E4M3 * tiles.abs()[normal] * (1 + 1e-6)).all()
    assert (err[~normal] <= 2.0 ** -10 * s.double()[..., None].expand_as(err)[~normal] * (1 + 1e-6)).all()


def test_dequantize_is_the_block_product():
    q, s = _weight((2, 200, 130), torch.Generator().manual_seed(2))
    w = dequantize(q, s, torch.float64)
    for e, n, k in [(0, 0, 0), (1, 199, 129), (0, 127, 128), (1, 128, 127)]:
        assert w[e, n, k] == q[e, n, k].double() * s[e, n // 128, k // 128].double()


@pytest.mark.parametrize("shape", [(3, 130, 70), (200, 260), (1, 64, 384), (2, 1, 129)], ids=str)
def test_transposed_weight_is_the_transpose_bitwise(shape):
    """The input gradient's K-major copy: the Triton kernel (interpreter) and the CPU path give the codes transposed
    bit for bit (tiles cut at both edges, 2-D and 3-D), and the pair dequantizes to the transposed weight."""
    from csattn.ops.fp8.grouped import transposed_weight

    q, s = _weight(shape, torch.Generator().manual_seed(sum(shape)))
    want = q.view(torch.uint8).transpose(-1, -2)
    codes = q if q.dim() == 3 else q[None]
    assert torch.equal(transpose_codes_triton(codes).view(torch.uint8), codes.view(torch.uint8).transpose(1, 2))
    wt, st = transposed_weight(q, s)
    assert wt.dtype == FP8_DTYPE and wt.is_contiguous() and st.is_contiguous()
    assert torch.equal(wt.view(torch.uint8), want)
    assert torch.equal(dequantize(wt, st, torch.float64), dequantize(q, s, torch.float64).transpose(-1, -2))
    with pytest.raises(ValueError, match="scale of weight"):
        transposed_weight(q, s[..., :-1])


def test_input_grad_copies_from_the_rows_per_expert():
    """The Gluon input gradient takes the K-major copy from :data:`COPY_ROWS_PER_EXPERT` rows an expert: not the
    256-expert slice at 16k tokens (~384 rows an expert), the ranks of the one-node plan (ep 8, ~1536)."""
    from csattn.ops.fp8.grouped import COPY_ROWS_PER_EXPERT, input_grad_copies

    assert not input_grad_copies(16384 * 6, 256) and input_grad_copies(8192 * 6 * 8 // 8, 256 // 8)
    assert input_grad_copies(COPY_ROWS_PER_EXPERT * 7, 7) and not input_grad_copies(COPY_ROWS_PER_EXPERT * 7 - 1, 7)
    assert not input_grad_copies(0, 0)


def test_fp8_linear_reference_vs_fp64(assert_close):
    g = torch.Generator().manual_seed(3)
    q, s = _weight((200, 260), g)
    x = torch.randn(3, 5, 260, generator=g, requires_grad=True)
    dy = torch.randn(3, 5, 200, generator=g)
    out = fp8_linear(x, q, s)
    (dx,) = torch.autograd.grad(out, x, dy)
    w = dequantize(q, s, torch.float64)
    assert_close(out, x.double() @ w.T, 1e-6, "out")
    assert_close(dx, dy.double() @ w, 1e-6, "dx")
    assert torch.equal(fp8_linear_ref(x, q, s), out)


def test_fp8_emulation_computes_what_the_kernels_compute(monkeypatch, assert_close):
    """The GPU model tests' reference for ``compute="fp8"`` (``tests.helpers.emulate_fp8_compute``): through the ops'
    CPU paths, the forward is the input quantized 1x128 times the dequantized weight and the input gradient the
    output gradient quantized 1x128 times it (the products ``fp8_linear_quantized`` / ``fp8_grouped_mm_quantized``
    name), not the unquantized product the references compute otherwise."""
    from csattn.ops.fp8 import fp8_linear_quantized
    from tests.helpers import emulate_fp8_compute

    g = torch.Generator().manual_seed(6)
    q, s = _weight((200, 260), g)
    x = _activations(9, 260, g).double().requires_grad_()
    dy = _activations(9, 200, g).double()
    plain = fp8_linear(x, q, s)
    emulate_fp8_compute(monkeypatch)
    out = fp8_linear(x, q, s)
    (dx,) = torch.autograd.grad(out, x, dy)
    assert torch.equal(out, fp8_linear_quantized(x.detach(), q, s))
    # the same products in fp64, summed in another order (dy @ W against dy @ (W^T)^T)
    assert_close(dx, fp8_linear_quantized(dy, q.t().contiguous(), s.t().contiguous()), 1e-12, "dx")
    assert not torch.equal(out, plain)  # the emulation is not the plain reference
    qe, se = _weight((3, 256, 384), g)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)
    a = _activations(14, 384, g).double()
    assert torch.equal(fp8_grouped_mm(a, qe, se, offs), fp8_grouped_mm_quantized(a, qe, se, offs))
    b = _activations(14, 256, g).double()
    assert torch.equal(fp8_grouped_mm(b, qe, se, offs, trans=True), fp8_grouped_mm_quantized(b, qe, se, offs, True))


def test_fp8_linear_under_autocast_is_a_linear():
    """Under autocast the op casts its input to the autocast dtype and returns that dtype, as ``nn.Linear`` does (every
    caller, csattn's ``Fp8Linear`` and the patched HF ``FP8Linear`` alike), gradient included."""
    g = torch.Generator().manual_seed(8)
    q, s = _weight((256, 384), g)
    x = torch.randn(5, 384, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8_linear(x, q, s)
    (dx,) = torch.autograd.grad(out.float().sum(), x)
    want = fp8_linear(x.detach().bfloat16(), q, s)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert dx.dtype == torch.float32 and torch.isfinite(dx).all() and dx.abs().sum() > 0


def test_fp8_ops_refuse_trainable_weights_and_bad_args():
    q, s = _weight((128, 128), torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="requires grad"):
        fp8_linear(torch.randn(2, 128), q.clone().requires_grad_(True), s)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(torch.randn(2, 128), q, s[:, :0])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.randn(2, 128), q.float(), s)
    with pytest.raises(ValueError, match="compute"):
        fp8_linear(torch.randn(2, 128), q, s, compute="int8")
    offs = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="not differentiable"):
        fp8_grouped_mm(torch.randn(2, 128, requires_grad=True), q[None], s[None], offs)
    with pytest.raises(ValueError, match="offs"):
        fp8_grouped_mm(torch.randn(2, 128), q[None], s[None], offs.long())



def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


# (E, N, K, counts per expert, rows past the last group): empty experts, ragged groups, one row, K and N not whole
# blocks, a tail of rows in no group (written as zeros)
GROUPED_CASES = [(4, 64, 128, [5, 0, 17, 3], 0), (3, 136, 200, [1, 0, 0], 2), (2, 256, 256, [0, 33], 0),
                 (5, 32, 384, [2, 9, 0, 1, 6], 3)]


@pytest.mark.parametrize("e,n,k,counts,tail", GROUPED_CASES)
@pytest.mark.parametrize("trans", [False, True])
def test_grouped_reference_vs_fp64(e, n, k, counts, tail, trans, assert_close):
    g = torch.Generator().manual_seed(e + n)
    q, s = _weight((e, n, k), g)
    offs = _offsets(counts)
    a = torch.randn(sum(counts) + tail, n if trans else k, generator=g)
    got = fp8_grouped_mm(a, q, s, offs, trans=trans)  # CPU: the reference
    want = torch.zeros(a.shape[0], k if trans else n, dtype=torch.float64)
    lo = 0
    for i, c in enumerate(counts):
        w = dequantize(q[i], s[i], torch.float64)
        want[lo:lo + c] = a[lo:lo + c].double() @ (w if trans else w.T)
        lo += c
    assert_close(got, want, 1e-6, "grouped reference")
    assert (got[sum(counts):] == 0).all()
    assert torch.equal(fp8_grouped_mm_ref(a, q, s, offs, trans), got)


@pytest.mark.parametrize("e,n,k,counts,tail", GROUPED_CASES)
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_low_rank_term_vs_fp64(e, n, k, counts, tail, trans, dtype, assert_close):
    """``low_rank``: rows of group ``e`` get ``scale * v w_e^T`` on top of the product (on the CPU: the reference
    path, a loop of matmuls; rows past ``offs[-1]`` stay zero); a term that does not fit the output is refused by
    name."""
    g = torch.Generator().manual_seed(e + n + 1)
    q, s = _weight((e, n, k), g)
    offs = _offsets(counts)
    n_out = k if trans else n
    a = torch.randn(sum(counts) + tail, n if trans else k, generator=g, dtype=torch.float64)
    v = torch.randn(a.shape[0], 4, generator=g, dtype=torch.float64)
    w = torch.randn(e, n_out, 4, generator=g, dtype=torch.float64)
    if tail:
        v[-tail:] = float("inf")  # rows of no group take no term
    got = fp8_grouped_mm(a.to(dtype), q, s, offs, trans=trans, low_rank=LowRank(v.to(dtype), w.to(dtype), 0.5))
    want = fp8_grouped_mm_ref(a, q, s, offs, trans)
    lo = 0
    for i, c in enumerate(counts):
        want[lo:lo + c] += 0.5 * v[lo:lo + c] @ w[i].T
        lo += c
    assert_close(got, want, 1e-12 if dtype == torch.float64 else 1e-5, "grouped + low rank")
    assert (got[sum(counts):] == 0).all()
    with pytest.raises(ValueError, match="low_rank"):
        fp8_grouped_mm(a, q, s, offs, trans=trans, low_rank=LowRank(v, w[:, :-1], 0.5))
    with pytest.raises(ValueError, match="low_rank"):
        fp8_grouped_mm(a, q, s, offs, trans=trans, low_rank=LowRank(v.float(), w.float(), 0.5))


@pytest.mark.parametrize("e,n,k,counts,tail", GROUPED_CASES)
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("mode", ["fp8", "w8a16"])
def test_grouped_kernel_vs_same_operands(e, n, k, counts, tail, trans, mode):
    """The kernel against fp64 math on the very operands it multiplies (the quantized activations in "fp8"):
    equal up to fp32 summation; and against the exact product of the unquantized activations within the
    quantization bound ``2^-4 |a| |W|`` (each activation moves by at most 2^-4 of itself)."""
    g = torch.Generator().manual_seed(7 * e + k)
    q, s = _weight((e, n, k), g)
    offs = _offsets(counts)
    m, c = sum(counts) + tail, n if trans else k
    a = _activations(m, c, g).half() if m > 3 else torch.randn(m, c, generator=g).half()
    out = torch.full((m, k if trans else n), float("nan"))
    if mode == "fp8":
        qa, sa = quantize_1x128_triton(a)
        grouped_mm_triton(qa, sa, q, s, offs, trans, out=out)
    else:
        grouped_mm_triton(a, None, q, s, offs, trans, out=out)
    assert torch.isfinite(out).all()
    same = fp8_grouped_mm_quantized(a, q, s, offs, trans, quantize_a=mode == "fp8")
    wabs = q.view(torch.uint8).bitwise_and(0x7F).view(FP8_DTYPE)  # |q|: clear the sign bit
    absprod = fp8_grouped_mm_quantized(a.abs(), wabs, s, offs, trans, quantize_a=False)
    assert ((out.double() - same).abs() <= 1e-5 * absprod).all()
    exact = fp8_grouped_mm_quantized(a, q, s, offs, trans, quantize_a=False)
    slack = 1e-5 * absprod
    if mode == "fp8":  # per activation: 2^-4 of itself (normal range) or half the subnormal spacing 2^-10 s
        tile = quantize_1x128_ref(a)[1].double().repeat_interleave(128, dim=-1)[:, :c]
        moved = EPS_E4M3 * a.abs().double() + 2.0 ** -10 * tile
        slack = slack + fp8_grouped_mm_quantized(moved, wabs, s, offs, trans, quantize_a=False)
    assert ((out.double() - exact).abs() <= slack).all()
    assert (out[sum(counts):] == 0).all()


def _fp8_experts(e: int, d: int, inter: int, g: torch.Generator):
    gu = _weight((e, 2 * inter, d), g)
    dn = _weight((e, d, inter), g)
    # about unit-variance outputs: scale the block scales by the fan-in
    return (gu[0], gu[1] * d ** -0.5 / 60), (dn[0], dn[1] * inter ** -0.5 / 60)


def _moe_run(x, w, ids, dout, gu, dn, backend, fp8_compute="fp8"):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = moe_experts(x, ids, w, gu[0], dn[0], LIMIT, backend, gate_up_scale=gu[1], down_scale=dn[1],
                      fp8_compute=fp8_compute)
    return [out.detach(), *torch.autograd.grad(out, (x, w), dout)]


@pytest.mark.parametrize("backend", ["reference", "grouped", "triton"])
def test_moe_fp8_experts_vs_dequantized_fp64(backend, assert_close):
    g = torch.Generator().manual_seed(11)
    t, e, k, d, inter = 12, 5, 2, 160, 136
    gu, dn = _fp8_experts(e, d, inter, g)
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    ids = torch.rand(t, e, generator=g).argsort(-1)[:, :k] % (e - 1)  # expert e-1 gets no rows
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    dout = torch.randn(t, d, generator=g, dtype=torch.float64)
    wgu, wdn = dequantize(*gu, torch.float64), dequantize(*dn, torch.float64)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = moe_experts(xe, ids, we, wgu, wdn, LIMIT, "reference")
    exact = [out.detach(), *torch.autograd.grad(out, (xe, we), dout)]
    got64 = _moe_run(x, w, ids, dout, gu, dn, backend)  # fp64: the reference loop, one expert dequantized at a time
    got = _moe_run(x.float(), w.float(), ids, dout.float(), gu, dn, backend)
    for name, a, b, c in zip(("out", "dx", "dweights"), got64, got, exact):
        assert_close(a, c, 1e-12, f"fp64 {name}")
        assert b.dtype == torch.float32
        assert_close(b, c, 1e-5, f"fp32 {name}")


def test_moe_fp8_refuses_trainable_or_half_given_scales():
    g = torch.Generator().manual_seed(12)
    gu, dn = _fp8_experts(2, 128, 128, g)
    x, ids, w = torch.randn(3, 128), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="both"):
        moe_experts(x, ids, w, gu[0], dn[0], LIMIT, gate_up_scale=gu[1])
    with pytest.raises(ValueError, match="gate_up_proj requires grad"):
        moe_experts(x, ids, w, gu[0].clone().requires_grad_(True), dn[0], LIMIT, gate_up_scale=gu[1],
                    down_scale=dn[1])
    with pytest.raises(ValueError, match="fp8_compute|compute"):
        moe_experts(x, ids, w, gu[0], dn[0], LIMIT, gate_up_scale=gu[1], down_scale=dn[1], fp8_compute="fp4")


@pytest.mark.parametrize("backend", ["reference", "grouped", "triton"])
def test_moe_lora_on_fp8_experts_vs_dequantized_fp64(backend, assert_close):
    """LoRA pairs per expert on frozen FP8 experts: output and the gradients of x, the routing weights and the four
    factors equal the fp64 loop on the dequantized weights with the same pairs."""
    g = torch.Generator().manual_seed(13)
    t, e, k, d, inter, r = 12, 5, 2, 160, 136, 4
    gu, dn = _fp8_experts(e, d, inter, g)
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    ids = torch.rand(t, e, generator=g).argsort(-1)[:, :k] % (e - 1)  # expert e-1 gets no rows
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    dout = torch.randn(t, d, generator=g, dtype=torch.float64)
    factors = (torch.randn(e, r, d, generator=g, dtype=torch.float64) * d ** -0.5,
               torch.randn(e, 2 * inter, r, generator=g, dtype=torch.float64) * r ** -0.5,
               torch.randn(e, r, inter, generator=g, dtype=torch.float64) * inter ** -0.5,
               torch.randn(e, d, r, generator=g, dtype=torch.float64) * r ** -0.5)

    def run(dtype, fp8):
        leaves = [t_.detach().to(dtype).requires_grad_() for t_ in (x, w, *factors)]
        xx, ww, ga, gb, da, db = leaves
        lora = {"gate_up_lora": ExpertLora(ga, gb, 2.0), "down_lora": ExpertLora(da, db, 0.5)}
        if fp8:
            out = moe_experts(xx, ids, ww, gu[0], dn[0], LIMIT, backend, gate_up_scale=gu[1], down_scale=dn[1],
                              **lora)
        else:
            out = moe_experts(xx, ids, ww, dequantize(*gu, dtype), dequantize(*dn, dtype), LIMIT, "reference",
                              **lora)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]

    exact = run(torch.float64, fp8=False)
    names = ("out", "dx", "dweights", "dgu_a", "dgu_b", "ddn_a", "ddn_b")
    for name, a, c in zip(names, run(torch.float64, fp8=True), exact):
        assert_close(a, c, 1e-12, f"fp64 {name}")
    for name, b, c in zip(names, run(torch.float32, fp8=True), exact):
        assert_close(b, c, 1e-5, f"fp32 {name}")


@pytest.mark.parametrize("e,n,k,counts,tail", GROUPED_CASES)
@pytest.mark.parametrize("rank", [4, 16, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_rank_add_kernel_vs_fp64(e, n, k, counts, tail, rank, dtype):
    """The low-rank term added in place by the Triton kernel (what a grouped GEMM without it gets on the GPU)
    against fp64: the product and the sum in fp32, one rounding to ``dtype``; rows past ``offs[-1]`` (poisoned
    with NaN in ``v``) keep their values, every other row its term."""
    from csattn.ops.fp8.triton import low_rank_add_triton

    g = torch.Generator().manual_seed(e + n + rank)
    offs = _offsets(counts)
    m = sum(counts) + tail
    out0 = torch.randn(m, n, generator=g, dtype=torch.float64)
    v = torch.randn(m, rank, generator=g, dtype=torch.float64)
    w = torch.randn(e, n, rank, generator=g, dtype=torch.float64)
    if tail:
        v[-tail:] = float("nan")
    out = out0.to(dtype)
    low_rank_add_triton(out, v.to(dtype), w.to(dtype), 0.75, offs)
    want = out0.to(dtype).double()
    lo = 0
    for i, c in enumerate(counts):
        want[lo:lo + c] += 0.75 * v[lo:lo + c].to(dtype).double() @ w[i].to(dtype).double().T
        lo += c
    assert torch.equal(out[sum(counts):], out0[sum(counts):].to(dtype))
    unit = torch.finfo(dtype).eps  # one rounding of the fp32 sum (fp32: its summation order)
    assert ((out.double() - want).abs() <= 4 * unit * (want.abs() + rank)).all()


def test_gluon_tile_walk_covers_every_group_and_the_rows_past_them(monkeypatch):
    """What the Gluon kernels' persistent programs walk (``gluon_tiles.tile_walk``): per group its first row, end row
    and the running count of its row tiles (an empty group none), the rows past ``offs[-1]`` as group E, the padding
    past every tile; row tiles enough for every group's partial last tile; one program an SM at most."""
    pytest.importorskip("triton.experimental.gluon")
    import csattn.ops.fp8.gluon_tiles as tiles

    monkeypatch.setattr(tiles, "sm_count", lambda device: 132)
    offs = torch.tensor([100, 100, 300, 429], dtype=torch.int32)  # 100, 0, 200, 129 rows; 21 rows past them
    walk = tiles.tile_walk(offs, 450, 512, 64, 256)
    assert (walk.e_p2, walk.tiles_m, walk.tiles_n) == (128, 8 + 4 + 1, 2)
    assert walk.grid == (26,)
    t = walk.table
    assert t[0, :5].tolist() == [0, 100, 100, 300, 429] and t[1, :5].tolist() == [100, 100, 300, 429, 450]
    assert t[2, :5].tolist() == [2, 2, 6, 9, 10] and (t[2, 5:] == 2 ** 30).all()
    assert tiles.tile_walk(torch.zeros(300, dtype=torch.int32), 10 ** 6, 128, 128, 128).e_p2 == 512
    assert tiles.tile_walk(offs, 10 ** 6, 4096, 128, 128).grid == (132,)


@pytest.mark.parametrize("e,m", [(1, 0), (4, 450), (37, 5000), (300, 10 ** 6)])
def test_group_table_kernel_equals_its_reference(e, m):
    """The group table in one Triton launch (interpreted on the CPU) equals the torch reference bit for bit: empty
    groups, rows past ``offs[-1]`` or none, the padding columns; a table too narrow for the groups goes to the
    reference."""
    import csattn.ops.fp8.gluon_tiles as tiles

    g = torch.Generator().manual_seed(e)
    counts = torch.randint(0, 2 * max(m, 1) // max(e, 1) + 1, (e,), generator=g)
    counts[::3] = 0
    offs = counts.cumsum(0).clamp_max(m).to(torch.int32)
    for bm in (64, 128):
        e_p2 = max(128, 1 << (e + 1).bit_length())
        got = tiles.group_table(offs, m, e_p2, bm)
        assert torch.equal(got, tiles.group_table_ref(offs, m, e_p2, bm)), (bm, got[:, :e + 2])
    assert torch.equal(tiles.group_table(offs, m, e + 1, 128), tiles.group_table_ref(offs, m, e + 1, 128))


def test_wide_forward_taken_up_to_its_rows_an_expert(monkeypatch):
    """The op's forward runs ``[64, 256]`` tiles (``gluon_wide.takes_wide``) where it was measured to win: up to
    ``WIDE_ROWS_PER_EXPERT`` rows an expert on average, weights of whole 256-column tiles, and only while
    ``WIDE_FORWARD`` is on; the ``[128, 128]`` kernel elsewhere (large groups, a dense weight)."""
    pytest.importorskip("triton.experimental.gluon")
    import csattn.ops.fp8.gluon_wide as wide

    per = wide.WIDE_ROWS_PER_EXPERT
    w = torch.empty(8, 512, 256, dtype=FP8_DTYPE, device="meta")
    assert wide.WIDE_FORWARD and wide.takes_wide(8 * per, w) and wide.takes_wide(384 * 8, w)
    assert not wide.takes_wide(8 * per + 1, w)
    assert not wide.takes_wide(16384, torch.empty(1, 4096, 2048, dtype=FP8_DTYPE, device="meta"))  # one dense group
    assert not wide.takes_wide(64, torch.empty(8, 384, 256, dtype=FP8_DTYPE, device="meta"))  # N not whole tiles
    monkeypatch.setattr(wide, "WIDE_FORWARD", False)
    assert not wide.takes_wide(64, w)

"""FP8 GEMM inputs quantized where they are made (csattn.ops.moe with frozen FP8 experts), on the CPU: the SwiGLU
kernels' quantized outputs (Triton's interpreter) bit for bit the 1x128 quantizer's reference of their own bf16 /
fp32 outputs, which stay unchanged; the quantized rows gathered bit for bit the quantized gathered rows; which
GEMMs take pre-quantized rows (:func:`takes_fp8_rows`, on faked devices) and the errors where they cannot go.
The kernels' GEMMs on such rows run on the GPU only (tests/ops/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.fp8 import (
    FP8_DTYPE,
    Fp8Rows,
    fp8_grouped_mm,
    low_rank_ref,
    quantize_1x128_ref,
    quantize_1x128_rows,
    takes_fp8_rows,
)
from csattn.ops.fp8 import fp8_grouped_mm_ref as fp8_grouped_ref
from csattn.ops.fp8 import grouped as fp8_grouped
from csattn.ops.moe import ExpertLora, moe_experts, swiglu_bwd_ref, swiglu_fwd_ref
from tests.helpers import rel_err

LIMIT = 1.5  # the clamps bind on a good share of the activations below


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan")).to(dtype)


def _poisoned_rows(n: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _nan((n, cols), FP8_DTYPE), _nan((n, -(-cols // 128)), torch.float32)


def _bitwise(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def _ulps(dtype: torch.dtype) -> float:
    """Relative distance of the kernels' outputs from fp64: a few fp32 roundings, then one to ``dtype``."""
    return torch.finfo(dtype).eps + 16 * torch.finfo(torch.float32).eps


def _problem(n: int, inter: int, dtype: torch.dtype, seed: int):
    """``gu [N, 2I]`` at and beyond the clamps with magnitudes over 6 decades (e4m3 subnormals inside a tile),
    ``w [N]`` with a zero (an all-zero row: scale 1), ``dh [N, I]``."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(n, 2 * inter, generator=g) * 2 * torch.logspace(-3, 3, 2 * inter)[None, :].sqrt()
    gu[0, :4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])
    gu[1, inter:inter + 4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])
    w = torch.rand(n, generator=g) + 0.1
    w[3] = 0
    dh = torch.randn(n, inter, generator=g) * torch.logspace(-3, 3, n)[:, None]
    return gu.to(dtype), w, dh.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [256, 200])
def test_swiglu_fwd_writes_h_quantized(dtype, inter):
    from csattn.ops.moe.triton import swiglu_fwd_triton

    n = 37  # not a multiple of the 16-row tile; I 200: a partial last column tile
    gu, w, _ = _problem(n, inter, dtype, seed=inter)
    h = swiglu_fwd_triton(gu, w, LIMIT, out=_nan((n, inter), dtype))
    h_also, rows = _nan((n, inter), dtype), _poisoned_rows(n, inter)
    assert swiglu_fwd_triton(gu, w, LIMIT, out=h_also, fp8_out=rows) is h_also
    assert torch.equal(h_also, h)  # h unchanged by the quantized output
    # the quantized output is the quantizer's of h as stored (rounded to its dtype), bit for bit
    _bitwise(rows, quantize_1x128_ref(h))
    only = _poisoned_rows(n, inter)
    assert swiglu_fwd_triton(gu, w, LIMIT, fp8_out=only, keep_h=False) is None
    _bitwise(only, rows)
    assert torch.equal(rows[1][3], torch.ones_like(rows[1][3]))  # w = 0: all-zero tiles take scale 1
    # h is the reference's up to the kernel's fp32 roundings and its own (one ulp of its dtype)
    exact = swiglu_fwd_ref(gu.double(), w.double(), LIMIT)
    assert ((h.double() - exact).abs() <= _ulps(dtype) * exact.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_bwd_writes_dgu_quantized(dtype):
    from csattn.ops.moe.triton import swiglu_bwd_triton

    n, inter = 37, 256  # two 128-column tiles per half
    gu, w, dh = _problem(n, inter, dtype, seed=3)
    poisoned = (_nan((n, 2 * inter), dtype), _nan((n, inter), dtype), _nan((n,), torch.float32))
    dgu, h, dw = swiglu_bwd_triton(gu, w, dh, LIMIT, out=poisoned)
    also = (_nan((n, 2 * inter), dtype), _nan((n, inter), dtype), _nan((n,), torch.float32))
    rows = _poisoned_rows(n, 2 * inter)
    got = swiglu_bwd_triton(gu, w, dh, LIMIT, out=also, fp8_out=rows)
    for a, b in zip(got, (dgu, h, dw)):
        # the plain outputs unchanged by the quantized one; dw too, bit for bit, as its two column blocks' sums (the
        # quantizing form's programs) add in the loop's order; over more blocks the order may move its last bits
        assert torch.equal(a, b)
    _bitwise(rows, quantize_1x128_ref(dgu))
    only = _poisoned_rows(n, 2 * inter)
    none, h2, dw2 = swiglu_bwd_triton(gu, w, dh, LIMIT, fp8_out=only, keep_dgu=False)
    assert none is None and torch.equal(h2, h) and torch.equal(dw2, dw)
    _bitwise(only, rows)
    lean = _poisoned_rows(n, 2 * inter)  # frozen experts without a down LoRA: neither dgu nor h is read after
    none, no_h, dw3 = swiglu_bwd_triton(gu, w, dh, LIMIT, fp8_out=lean, keep_dgu=False, keep_h=False)
    assert none is None and no_h is None and torch.equal(dw3, dw)
    _bitwise(lean, rows)
    exact = swiglu_bwd_ref(gu.double(), w.double(), dh.double(), LIMIT)[0]
    assert rel_err(dgu, exact) < _ulps(dtype)  # in norm: silu' cancels in fp32 (1 - sigmoid near 1)


def test_swiglu_quantized_outputs_refuse_bad_args():
    from csattn.ops.moe.triton import swiglu_bwd_triton, swiglu_fwd_triton

    gu, w, dh = _problem(5, 200, torch.float32, seed=1)
    with pytest.raises(ValueError, match="I % 128"):
        swiglu_bwd_triton(gu, w, dh, LIMIT, fp8_out=_poisoned_rows(5, 400))
    with pytest.raises(ValueError, match="keep_h=False"):
        swiglu_fwd_triton(gu, w, LIMIT, keep_h=False)
    with pytest.raises(ValueError, match="keep_dgu=False"):
        swiglu_bwd_triton(gu, w, dh, LIMIT, keep_dgu=False)
    with pytest.raises(ValueError, match="fp8_out must be"):
        swiglu_fwd_triton(gu, w, LIMIT, fp8_out=_poisoned_rows(5, 256))


def test_quantize_then_gather_is_gather_then_quantize():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 300, generator=g) * torch.logspace(-3, 3, 13)[:, None]).bfloat16()
    x[4, :128] = 0
    token = torch.randint(0, 13, (40,), generator=g)
    got = Fp8Rows(*quantize_1x128_ref(x)).index_select(token)
    assert got.q.dtype == FP8_DTYPE
    _bitwise(got, quantize_1x128_ref(x[token]))


@pytest.mark.parametrize("k", [1, 3])
def test_quantize_into_expert_rows_is_quantize_then_gather(monkeypatch, k):
    """The one-pass quantizer into expert order (the kernel under Triton's interpreter, and the CPU's reference):
    bit for bit the token rows quantized and gathered, rows and scales, on poisoned outputs."""
    from csattn.ops.fp8.triton import quantize_rows_triton
    from csattn.ops.moe import route_plan

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5 + k)
    t, d = 11, 300  # a partial last column tile
    x = (torch.randn(t, d, generator=g) * torch.logspace(-3, 3, t)[:, None]).bfloat16()
    x[4, :128] = 0
    experts = torch.stack([torch.randperm(7, generator=g)[:k] for _ in range(t)])
    plan = route_plan(experts, 7)
    want = Fp8Rows(*quantize_1x128_ref(x)).index_select(plan.token)
    dest = plan.inv.view(t, k)
    rows = _poisoned_rows(t * k, d)
    assert quantize_rows_triton(x, dest, out=rows, rows=4)[0] is rows[0]
    _bitwise(rows, want)
    _bitwise(quantize_1x128_rows(x, dest), want)
    with pytest.raises(ValueError, match="dest"):
        quantize_1x128_rows(x, dest.int())


def _fake_gpu(monkeypatch, cap: tuple[int, int], gluon: bool = True) -> torch.device:
    """A CUDA device of capability ``cap`` as the predicate sees it (it reads the device type and capability)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(fp8_grouped, "interpreting", lambda: False)
    monkeypatch.setattr(fp8_grouped, "_gluon_available", lambda: gluon)
    return torch.device("cuda", 0)


def test_takes_fp8_rows_where_the_gemm_quantizes(monkeypatch):
    wide = torch.empty(2, 256, 384, dtype=FP8_DTYPE)  # N, K multiples of 128: the Gluon kernel's
    odd = torch.empty(2, 192, 384, dtype=FP8_DTYPE)
    bf16 = torch.bfloat16
    for trans in (False, True):  # the CPU runs the reference, on the rows as given
        assert not takes_fp8_rows(bf16, torch.device("cpu"), wide, "fp8", trans)
    dev = _fake_gpu(monkeypatch, (9, 0))
    assert takes_fp8_rows(bf16, dev, wide, "fp8", False) and takes_fp8_rows(bf16, dev, wide, "fp8", True)
    assert takes_fp8_rows(torch.float16, dev, wide, "fp8", True)
    assert takes_fp8_rows(bf16, dev, odd, "fp8", False)  # the Triton kernel
    assert not takes_fp8_rows(bf16, dev, odd, "fp8", True)  # W8A16 there
    assert not takes_fp8_rows(bf16, dev, wide, "w8a16", False)
    assert not takes_fp8_rows(torch.float32, dev, wide, "fp8", False)  # the reference
    dev = _fake_gpu(monkeypatch, (9, 0), gluon=False)
    assert takes_fp8_rows(bf16, dev, wide, "fp8", False) and not takes_fp8_rows(bf16, dev, wide, "fp8", True)
    dev = _fake_gpu(monkeypatch, (8, 9))  # Ada: FP8 MMA, no Gluon kernel
    assert takes_fp8_rows(bf16, dev, wide, "fp8", False) and not takes_fp8_rows(bf16, dev, wide, "fp8", True)
    dev = _fake_gpu(monkeypatch, (8, 0))  # no FP8 MMA
    assert not takes_fp8_rows(bf16, dev, wide, "fp8", False)
    with pytest.raises(ValueError, match="compute"):
        takes_fp8_rows(bf16, dev, wide, "fp4", False)


def test_fp8_rows_refused_where_no_kernel_takes_them():
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(2, 256, 128, generator=g) * 50).to(FP8_DTYPE)
    scale = torch.rand(2, 2, 1, generator=g) * 1e-3
    offs = torch.tensor([3, 6], dtype=torch.int32)
    a = torch.randn(6, 128, generator=g).bfloat16()
    rows = Fp8Rows(*quantize_1x128_ref(a))
    with pytest.raises(ValueError, match="takes_fp8_rows"):  # on the CPU the reference runs, on unquantized rows
        fp8_grouped_mm(rows, weight, scale, offs, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_grouped_mm(rows, weight, scale, offs)
    with pytest.raises(ValueError, match="Fp8Rows must be"):
        fp8_grouped_mm(Fp8Rows(rows.q, rows.s[:, :0]), weight, scale, offs, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="columns"):
        fp8_grouped_mm(rows, weight, scale, offs, trans=True, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):  # a tensor's output is in its own dtype
        fp8_grouped_mm(a, weight, scale, offs, out_dtype=torch.float32)
    assert torch.equal(fp8_grouped_mm(a, weight, scale, offs, out_dtype=torch.bfloat16),
                       fp8_grouped_mm(a, weight, scale, offs))


def _emulated_fp8_mm(a, weight, scale, offs, trans=False, compute="fp8", out_dtype=None, low_rank=None):
    """What the FP8 kernels compute, on the CPU: the rows quantized 1x128 (unless given so), dequantized, times
    each dequantized expert in fp32, plus the low-rank term in fp32, rounded once to the rows' dtype."""
    rows = a if isinstance(a, Fp8Rows) else Fp8Rows(*quantize_1x128_ref(a))
    deq = rows.q.float() * rows.s.repeat_interleave(128, dim=-1)[:, :rows.q.shape[1]]
    out = fp8_grouped_ref(deq, weight, scale, offs, trans)
    if low_rank is not None:
        out = out + low_rank.scale * low_rank_ref(low_rank.v.float(), low_rank.w.float(), offs)
    return out.to(out_dtype or a.dtype)


@pytest.mark.parametrize("backend", ["grouped", "triton"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_moe_hands_its_gemms_rows_quantized_where_made(backend, with_lora, monkeypatch):
    """The MoE's wiring with the FP8 kernels emulated on the CPU: where every GEMM takes quantized rows the step
    (output, dx, dweights, the LoRA factors' gradients) is bit for bit the one whose GEMMs quantize their bf16
    inputs themselves; the bf16 rows are not made where nothing needs them (no LoRA)."""
    import csattn.ops.moe.grouped as moe_grouped

    g = torch.Generator().manual_seed(9)
    t, e, k, d, inter, r = 12, 4, 2, 256, 128, 8
    gu = ((torch.randn(e, 2 * inter, d, generator=g) * 50).to(FP8_DTYPE), torch.rand(e, 2, 2, generator=g) * 1e-3)
    dn = ((torch.randn(e, d, inter, generator=g) * 50).to(FP8_DTYPE), torch.rand(e, 2, 1, generator=g) * 2e-3)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.rand(t, e, generator=g).argsort(-1)[:, :k] % (e - 1)  # expert e-1 gets no rows
    w = (torch.rand(t, k, generator=g) + 0.1).bfloat16()
    dout = torch.randn(t, d, generator=g).bfloat16()
    factors = [(torch.randn(shape, generator=g) * 0.1).bfloat16()
               for shape in ((e, r, d), (e, 2 * inter, r), (e, r, inter), (e, d, r))] if with_lora else []
    given = []

    def gemm(a, *args, **kwargs):
        given.append(isinstance(a, Fp8Rows))
        return _emulated_fp8_mm(a, *args, **kwargs)

    monkeypatch.setattr(moe_grouped, "fp8_grouped_mm", gemm)

    def run(rows: bool):
        monkeypatch.setattr(moe_grouped, "takes_fp8_rows", lambda *args: rows)
        given.clear()
        leaves = [v.detach().requires_grad_() for v in (x, w, *factors)]
        lora = {"gate_up_lora": ExpertLora(leaves[2], leaves[3], 2.0),
                "down_lora": ExpertLora(leaves[4], leaves[5], 0.5)} if with_lora else {}
        out = moe_experts(leaves[0], ids, leaves[1], gu[0], dn[0], LIMIT, backend, gate_up_scale=gu[1],
                          down_scale=dn[1], **lora)
        grads = torch.autograd.grad(out, leaves, dout)
        assert given == [rows] * 4  # x, h forward; dout, dgu backward
        return [out, *grads]

    fused, separate = run(True), run(False)
    assert torch.isfinite(fused[0]).all() and fused[0].abs().max() > 0
    for a, b in zip(fused, separate):
        assert torch.equal(a, b)

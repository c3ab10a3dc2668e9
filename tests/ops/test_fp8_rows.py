"""FP8 GEMM inputs quantized where they are made (csattn.ops.moe with frozen FP8 experts), on the CPU: the SwiGLU
kernels' quantized outputs (Triton's interpreter) bit for bit the 1x128 quantizer's reference of their own bf16 /
fp32 outputs, which stay unchanged; the quantized rows gathered bit for bit the quantized gathered rows; which
GEMMs take pre-quantized rows (:func:`takes_fp8_rows`, on faked devices) and the errors where they cannot go.
The kernels' GEMMs on such rows run on the GPU only (tests/ops/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.fp8 import FP8_DTYPE, Fp8Rows, fp8_grouped_mm, quantize_1x128_ref, takes_fp8_rows
from csattn.ops.fp8 import grouped as fp8_grouped


def _bitwise(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def test_quantize_then_gather_is_gather_then_quantize():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 300, generator=g) * torch.logspace(-3, 3, 13)[:, None]).bfloat16()
    x[4, :128] = 0
    token = torch.randint(0, 13, (40,), generator=g)
    got = Fp8Rows(*quantize_1x128_ref(x)).index_select(token)
    assert got.q.dtype == FP8_DTYPE
    _bitwise(got, quantize_1x128_ref(x[token]))


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

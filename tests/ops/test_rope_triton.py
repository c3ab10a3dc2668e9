"""Fused per-head RMSNorm + RoPE and plain RoPE (Triton; CPU interpreter or CUDA) against the PyTorch reference:
outputs and input gradients, head counts that do not fill a program's head block, non-power-of-two head dims,
forward and inverse rotation; bf16 on the GPU within the error of the same computation in bf16 PyTorch."""

from __future__ import annotations

import pytest
import torch

from csattn.layers.modules import rms_norm_unweighted
from csattn.ops.rope import apply_rope
from tests.helpers import poison_kernel_outputs, rel_err


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.rope.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.rope.triton)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_rope = pytest.importorskip("csattn.ops.rope.triton")


def _reference(x, cos, sin, norm, inverse):
    y = rms_norm_unweighted(x, 1e-6) if norm else x
    return apply_rope(y, cos, sin, inverse=inverse)


def _fused(x, cos, sin, norm, inverse):
    if norm:
        return triton_rope.head_norm_rope_triton(x, cos, sin, 1e-6)
    return triton_rope.rope_heads_triton(x, cos, sin, inverse=inverse)


CASES = [(True, False), (False, False), (False, True)]
IDS = ["norm_rope", "rope", "inverse_rope"]


@pytest.mark.parametrize("norm,inverse", CASES, ids=IDS)
@pytest.mark.parametrize("rows,heads,dim,rope", [(7, 5, 24, 8), (3, 4, 64, 64), (1, 1, 16, 2)])
def test_matches_reference_fp32(norm, inverse, rows, heads, dim, rope):
    g = torch.Generator().manual_seed(rows * heads + dim)
    x = torch.randn(rows, heads, dim, dtype=torch.float64, generator=g) * 3
    ang = torch.randn(rows, rope // 2, dtype=torch.float64, generator=g) * 10
    dy = torch.randn(rows, heads, dim, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_()
    ref = _reference(xr, ang.cos(), ang.sin(), norm, inverse)
    (gref,) = torch.autograd.grad(ref, xr, dy)
    xf = x.float().to(DEVICE).requires_grad_()
    got = _fused(xf, ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE), norm, inverse)
    (gx,) = torch.autograd.grad(got, xf, dy.float().to(DEVICE))
    assert rel_err(got.cpu(), ref) < 1e-6 and rel_err(gx.cpu(), gref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("norm,inverse", CASES, ids=IDS)
def test_bf16_within_bf16_pytorch_error(norm, inverse):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 64, 512, device="cuda", generator=g)
    ang = torch.rand(4096, 32, device="cuda", generator=g) * 1000
    dy = torch.randn(4096, 64, 512, device="cuda", generator=g)
    cos, sin = ang.cos(), ang.sin()
    exact = {}
    xd = x.double().requires_grad_()
    exact["y"] = _reference(xd, cos.double(), sin.double(), norm, inverse)
    (exact["dx"],) = torch.autograd.grad(exact["y"], xd, dy.double())
    results = {}
    for name, fn in (("torch", _reference), ("triton", _fused)):
        xb = x.bfloat16().requires_grad_()
        y = fn(xb, cos, sin, norm, inverse)
        (dx,) = torch.autograd.grad(y, xb, dy.bfloat16())
        results[name] = {"y": y, "dx": dx}
    for key in ("y", "dx"):
        assert rel_err(results["triton"][key], exact[key]) <= 2 * rel_err(results["torch"][key], exact[key]) + 1e-6


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse_rope"])
@pytest.mark.parametrize("rows,heads,dim,rope", [(7, 5, 24, 8), (3, 17, 64, 64), (2, 3, 20, 6)])
def test_in_place_rotation_matches_reference(inverse, rows, heads, dim, rope):
    """The in-place rotation of the trailing channels equals ``apply_rope`` (fp32 math, as the other kernels),
    leaves the leading channels' bits as they were, and returns its input."""
    g = torch.Generator().manual_seed(rows * heads + dim + rope)
    x = torch.randn(rows, heads, dim, dtype=torch.float64, generator=g) * 3
    ang = torch.randn(rows, rope // 2, dtype=torch.float64, generator=g) * 10
    ref = apply_rope(x, ang.cos(), ang.sin(), inverse=inverse)
    xd = x.float().to(DEVICE)
    cos, sin = ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)
    got = triton_rope.rope_heads_triton_(xd, cos, sin, inverse=inverse)
    assert got.data_ptr() == xd.data_ptr()
    assert torch.equal(got[..., : dim - rope].cpu(), x[..., : dim - rope].float())
    assert rel_err(got.cpu(), ref) < 1e-6


def test_in_place_rotation_refuses_a_strided_input():
    x = torch.zeros(4, 3, 16, dtype=torch.float64)[:, :, :8]
    with pytest.raises(ValueError, match="contiguous"):
        triton_rope.rope_heads_triton_(x, torch.ones(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))

"""The lean RMSNorm: same forward as the plain autograd form, same gradients, and only the input and one fp32
scale per row saved for the backward."""

import pytest
import torch

from csattn.ops.rms_norm import rms_norm, rms_norm_ref
from tests.helpers import poison_kernel_outputs, rel_err


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.rms_norm

    poison_kernel_outputs(monkeypatch, csattn.ops.rms_norm)


plain_rms_norm = rms_norm_ref  # the plain autograd form (naive.py)


def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_plain_autograd(dtype, assert_close):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 96, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(64, 96, generator=g).to(dtype)
    y = rms_norm(x, w, 1e-6)
    ref = plain_rms_norm(x, w, 1e-6)
    assert torch.equal(y, ref)  # the forward is the same computation
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    # oracle: fp64 gradients of the plain form; the lean backward must be as close as the plain one in `dtype`
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ex, ew = torch.autograd.grad(plain_rms_norm(x64, w64, 1e-6), (x64, w64), dy.double())
    px, pw = torch.autograd.grad(ref, (x, w), dy)
    floor = 1e-6 if dtype == torch.float32 else 1e-2
    for got, plain, exact, what in ((gx, px, ex, "dx"), (gw, pw, ew, "dw")):
        assert_close(got, exact, max(2 * rel_err(plain, exact), floor), what)


def test_saves_only_input_and_row_scales():
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(128, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, w, 1e-6)
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in (x.data_ptr(), w.data_ptr()))
    assert extra == 32 * 4  # one fp32 scale per row; the plain form keeps two fp32 copies of x (32 KiB)


def test_row_chunks_change_nothing_per_row(monkeypatch):
    """Several row chunks give the same output and input gradient bit for bit, and the same weight gradient."""
    import csattn.ops.rms_norm as mod

    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 2, 24, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(24, generator=g)).requires_grad_()
    dy = torch.randn(37, 2, 24, generator=g)
    results = []
    for chunk_bytes in (mod.CHUNK_BYTES, 4 * 24 * 5):  # one chunk; chunks of 5 rows
        monkeypatch.setattr(mod, "CHUNK_BYTES", chunk_bytes)
        y = rms_norm(x, w, 1e-6)
        results.append((y, *torch.autograd.grad(y, (x, w), dy)))
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert rel_err(gw1, gw0) < 1e-6  # the sum over rows is taken chunk by chunk


# ---------------------------------------------------------------------------------------------- Triton kernels
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def nan_buffers(monkeypatch):
    kernels = pytest.importorskip("csattn.ops.rms_norm.triton")

    def poisoned(shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device).fill_(float("nan"))

    monkeypatch.setattr(kernels, "_empty", poisoned)
    return kernels


@pytest.mark.parametrize("rows,c", [(7, 24), (1, 5), (40, 96), (0, 8)], ids=["7x24", "1x5", "40x96", "no_rows"])
def test_triton_matches_reference_fp64(rows, c, nan_buffers, monkeypatch):
    """The kernels (CPU interpreter or CUDA) against the PyTorch rows in fp64: the output, the scales and both
    gradients, with every buffer they fill NaN-poisoned; more rows than backward programs."""
    monkeypatch.setattr(nan_buffers, "_programs", lambda device: 3)
    g = torch.Generator().manual_seed(rows * 31 + c)
    x = torch.randn(rows, c, dtype=torch.float64, generator=g) * 3
    w = 1 + 0.5 * torch.randn(c, dtype=torch.float64, generator=g)
    dy = torch.randn(rows, c, dtype=torch.float64, generator=g)
    results = {}
    for backend in ("reference", "triton"):
        xi, wi = x.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
        y = rms_norm(xi, wi, 1e-6, backend=backend)
        results[backend] = [y.detach().cpu(), *(t.cpu() for t in torch.autograd.grad(y, (xi, wi), dy.to(DEVICE)))]
    for name, got, ref in zip(["out", "dx", "dw"], results["triton"], results["reference"]):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        assert rel_err(got, ref) < 1e-13, f"{name}: {rel_err(got, ref):.2e}"


def test_triton_backward_without_weight_gradient(nan_buffers):
    from csattn.ops.rms_norm import rms_norm_backward, rms_norm_forward

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, dtype=torch.float64, generator=g).to(DEVICE)
    w = torch.randn(16, dtype=torch.float64, generator=g).to(DEVICE)
    dy = torch.randn(6, 16, dtype=torch.float64, generator=g).to(DEVICE)
    _, rstd = rms_norm_forward(x, w, 1e-6, backend="triton")
    dx, dw = rms_norm_backward(x, w, rstd, dy, True, False, backend="triton")
    ref, _ = rms_norm_backward(x, w, rstd, dy, True, False, backend="reference")
    assert dw is None and rel_err(dx, ref) < 1e-13


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend must be"):
        rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("c", [512, 1024, 4096])
def test_gpu_bf16_within_twice_torch(c):
    """bf16 rows at the V4-Flash widths: the kernels within twice the error of the plain bf16 PyTorch form."""
    g = torch.Generator(device="cuda").manual_seed(c)
    x = (torch.randn(8192, c, device="cuda", generator=g) * 2).bfloat16()
    w = (1 + 0.3 * torch.randn(c, device="cuda", generator=g))
    dy = torch.randn(8192, c, device="cuda", generator=g).bfloat16()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    exact = [plain_rms_norm(x64, w64, 1e-6)]
    exact += list(torch.autograd.grad(exact[0], (x64, w64), dy.double()))
    errs = {}
    for name, fn in (("torch", plain_rms_norm), ("triton", lambda a, b, e: rms_norm(a, b, e, backend="triton"))):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        got = [y, *torch.autograd.grad(y, (xi, wi), dy)]
        errs[name] = [rel_err(a, b) for a, b in zip(got, exact)]
    for what, e_ref, e_tri in zip(["out", "dx", "dw"], errs["torch"], errs["triton"]):
        assert e_tri <= 2 * e_ref + 1e-6, f"{what}: triton {e_tri:.3e} vs bf16 torch {e_ref:.3e}"

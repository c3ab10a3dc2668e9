"""Fused mHC kernels (Triton; CPU interpreter or CUDA) against the PyTorch reference in fp64: the pre-mapping
(post, comb, collapsed), the head and the combine, outputs and every gradient (streams, block output, fn, base,
scale, post, comb), with every buffer the kernels fill NaN-poisoned first. Odd sizes: hidden sizes that are not
a power of two, hc_mult 2 / 3 / 4, one row, no rows, more rows than one program. On the GPU, bf16 at the
V4-Flash geometry within twice the error of the same computation in bf16 PyTorch."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.mhc import MhcConfig, hc_combine, hc_combine_ref, hc_head, hc_head_ref, hc_pre, hc_pre_ref, hc_site
from csattn.ops.rms_norm import rms_norm
from tests.helpers import rel_err

kernels = pytest.importorskip("csattn.ops.mhc.triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Every buffer the kernels fill starts as NaN, so an element a kernel forgets to write fails the test."""
    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(kernels, "_empty", poisoned)


def _site_inputs(t, n, d, head, gen):
    width = n if head else (2 + n) * n
    x = torch.randn(t, n, d, dtype=torch.float64, generator=gen) * 2
    fn = 0.3 * torch.randn(width, n * d, dtype=torch.float64, generator=gen)
    base = 0.5 * torch.randn(width, dtype=torch.float64, generator=gen)
    scale = 1 + 0.3 * torch.randn(1 if head else 3, dtype=torch.float64, generator=gen)
    return [x, fn, base, scale]


def _run_site(backend, inputs, dtype, head, iters, cotangents, config=None):
    """Outputs and gradients of one site (pre-mapping or head) with streams in ``dtype``."""
    wide = torch.promote_types(dtype, torch.float32)
    x, fn, base, scale = inputs
    leaves = [x.to(DEVICE, dtype).requires_grad_()] + [p.to(DEVICE, wide).requires_grad_() for p in (fn, base, scale)]
    if head:
        outs = (hc_head(*leaves, hc_eps=EPS, norm_eps=EPS, backend=backend, config=config),)
    else:
        outs = hc_pre(*leaves, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS, backend=backend, config=config)
    loss = sum((o.double() * c.to(DEVICE)).sum() for o, c in zip(outs, cotangents) if c is not None)
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach().cpu() for o in outs], [g.cpu() for g in grads]


def _cotangents(outs, gen, keep):
    return [torch.randn(o.shape, dtype=torch.float64, generator=gen) if k else None for o, k in zip(outs, keep)]


SIZES = [(5, 4, 24), (1, 2, 7), (9, 3, 40), (37, 4, 12)]
SIZE_IDS = ["n4_D24", "T1_n2_D7", "n3_D40", "T37_n4_D12"]


@pytest.mark.parametrize("t,n,d", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_site_fp64(t, n, d, head):
    _check_site_fp64(t, n, d, head)


SMALL_TILES = MhcConfig(fwd_rows=16, fwd_k=16, fwd_k_fma=16, fwd_d=8, coef_rows=4, coef_d=8, bwd_rows=16, bwd_k=16,
                        comb_rows=2, comb_d=8, scratch_rows=8)


@pytest.mark.slow  # many small tiles under the interpreter
@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_site_fp64_small_tiles(head):
    """Many programs per kernel: row blocks, channel tiles, backward scratch chunks."""
    _check_site_fp64(37, 4, 12, head, SMALL_TILES)
    _check_site_fp64(23, 3, 20, head, SMALL_TILES)
    if not head:
        _check_combine_fp64(37, 4, 12, SMALL_TILES)


def _check_site_fp64(t, n, d, head, config=None):
    gen = torch.Generator().manual_seed(t * 100 + n * 10 + d)
    inputs = _site_inputs(t, n, d, head, gen)
    plain = (hc_head_ref(*inputs, EPS, EPS),) if head else hc_pre_ref(*inputs, 20, EPS, EPS)
    cot = _cotangents(plain, gen, [True] * 3)
    ref_outs, ref_grads = _run_site("reference", inputs, torch.float64, head, 20, cot)
    outs, grads = _run_site("triton", inputs, torch.float64, head, 20, cot, config)
    names = ["collapsed"] if head else ["post", "comb", "collapsed"]
    for name, o, r in zip(names, outs, ref_outs):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert rel_err(o, r) < 1e-12, name
    for name, g, r in zip(["streams", "fn", "base", "scale"], grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, r) < 1e-11, f"grad {name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("keep", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["post_only", "comb_only", "collapsed_only"])
def test_pre_each_output_path(keep):
    """The gradient through each output alone (the others' gradients are zeros), 3 Sinkhorn rounds."""
    gen = torch.Generator().manual_seed(3)
    inputs = _site_inputs(6, 4, 10, False, gen)
    cot = _cotangents(hc_pre_ref(*inputs, 3, EPS, EPS), gen, keep)
    _, ref_grads = _run_site("reference", inputs, torch.float64, False, 3, cot)
    _, grads = _run_site("triton", inputs, torch.float64, False, 3, cot)
    for name, g, r in zip(["streams", "fn", "base", "scale"], grads, ref_grads):
        assert rel_err(g, r) < 1e-11, f"grad {name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("dtype,split",
                         [(torch.float32, (0, 0)), (torch.bfloat16, (0, 0)), (torch.bfloat16, (1, 0)),
                          (torch.bfloat16, (1, 1))], ids=["fp32", "bf16", "bf16-split", "bf16-split-both"])
def test_pre_low_precision(dtype, split):
    """fp32 math inside for fp32 and bf16 streams (bf16 with the split-operand products in neither pass, in the
    forward only, or in both, the default): against fp64 on the same rounded inputs, the fp32 outputs and parameter
    gradients carry fp32-level error, the stream-dtype ones their own rounding."""
    gen = torch.Generator().manual_seed(11)
    inputs = _site_inputs(20, 4, 24, False, gen)
    inputs[0] = inputs[0].to(dtype).double()
    cot = _cotangents(hc_pre_ref(*inputs, 20, EPS, EPS), gen, [True] * 3)
    cot[2] = cot[2].to(dtype).double()  # the gradient of a stream-dtype output arrives in that dtype
    ref_outs, ref_grads = _run_site("reference", inputs, torch.float64, False, 20, cot)
    outs, grads = _run_site("triton", inputs, dtype, False, 20, cot, MhcConfig(fwd_split=split[0], bwd_split=split[1]))
    low = 2e-2 if dtype == torch.bfloat16 else 1e-5  # tensors stored in the stream dtype
    for name, o, r, tol in zip(["post", "comb", "collapsed"], outs, ref_outs, [1e-5, 1e-5, low]):
        assert rel_err(o, r) < tol, f"{name}: {rel_err(o, r):.2e}"
    for name, g, r, tol in zip(["streams", "fn", "base", "scale"], grads, ref_grads, [low, 1e-5, 1e-5, 1e-5]):
        assert rel_err(g, r) < tol, f"grad {name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_site_no_rows(head):
    gen = torch.Generator().manual_seed(0)
    inputs = _site_inputs(0, 4, 8, head, gen)
    cot = [torch.zeros(0, 4), torch.zeros(0, 4, 4), torch.zeros(0, 8)]
    outs, grads = _run_site("triton", inputs, torch.float32, head, 20, [cot[2]] if head else cot)
    assert [tuple(o.shape) for o in outs] == ([(0, 8)] if head else [(0, 4), (0, 4, 4), (0, 8)])
    assert grads[0].shape == (0, 4, 8)
    assert all(float(g.abs().sum()) == 0.0 for g in grads[1:])


def _run_normed_site(backend, inputs, norm_w, dtype, head, cotangents, fused=True, config=None):
    """Outputs and gradients of a site followed by its RMSNorm: the fused op (``norm_weight=``) or, with
    ``fused=False``, the site then :func:`rms_norm` as two autograd nodes."""
    wide = torch.promote_types(dtype, torch.float32)
    x, fn, base, scale = inputs
    leaves = [x.to(DEVICE, dtype).requires_grad_()] + [p.to(DEVICE, wide).requires_grad_()
                                                       for p in (fn, base, scale, norm_w)]
    kw = dict(norm_weight=leaves[4], rms_eps=1e-5) if fused else {}
    if head:
        outs = [hc_head(*leaves[:4], hc_eps=EPS, norm_eps=EPS, **kw, backend=backend, config=config)]
    else:
        outs = list(hc_pre(*leaves[:4], sinkhorn_iters=20, hc_eps=EPS, norm_eps=EPS, **kw, backend=backend,
                           config=config))
    if not fused:
        outs[-1] = rms_norm(outs[-1], leaves[4], 1e-5)
    loss = sum((o.double() * c.to(DEVICE)).sum() for o, c in zip(outs, cotangents))
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach().cpu() for o in outs], [g.cpu() for g in grads]


@pytest.mark.parametrize("t,n,d", [(5, 4, 24), (37, 4, 12), (1, 2, 7)], ids=["n4_D24", "T37", "T1_n2_D7"])
@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_site_with_norm_fp64(t, n, d, head):
    """The site with its RMSNorm fused (the collapse recomputed in the backward, over several programs) equals the
    reference site followed by the norm: outputs and the gradients of the streams, the site's parameters and the
    norm weight."""
    gen = torch.Generator().manual_seed(t * 7 + n + d)
    inputs = _site_inputs(t, n, d, head, gen)
    norm_w = 1 + 0.5 * torch.randn(d, dtype=torch.float64, generator=gen)
    plain = (hc_head_ref(*inputs, EPS, EPS),) if head else hc_pre_ref(*inputs, 20, EPS, EPS)
    cot = _cotangents(plain, gen, [True] * 3)
    ref_outs, ref_grads = _run_normed_site("reference", inputs, norm_w, torch.float64, head, cot)
    outs, grads = _run_normed_site("triton", inputs, norm_w, torch.float64, head, cot,
                                   config=MhcConfig(collapse_rows=4, collapse_d=8))
    for o, r in zip(outs, ref_outs):
        assert o.shape == r.shape and rel_err(o, r) < 1e-12
    for name, g, r in zip(["streams", "fn", "base", "scale", "norm_weight"], grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, r) < 1e-11, f"grad {name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_site_with_norm_equals_unfused(head):
    """Fused or not, the same bits: the backward's recomputed collapse is the forward's (one kernel helper writes
    both), so the RMSNorm backward sees the same input it would have kept."""
    gen = torch.Generator().manual_seed(21)
    inputs = _site_inputs(19, 4, 24, head, gen)
    inputs[0] = inputs[0].float().double()
    norm_w = 1 + 0.5 * torch.randn(24, dtype=torch.float64, generator=gen)
    plain = (hc_head_ref(*inputs, EPS, EPS),) if head else hc_pre_ref(*inputs, 20, EPS, EPS)
    cot = _cotangents(plain, gen, [True] * 3)
    fused = _run_normed_site("triton", inputs, norm_w, torch.float32, head, cot)
    split = _run_normed_site("triton", inputs, norm_w, torch.float32, head, cot, fused=False)
    for a, b in zip(fused[0] + fused[1], split[0] + split[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32_norm", "bf16_norm", "bf16"])
def test_rebuild_gives_the_block_input_bit_for_bit(backend, dtype, norm):
    """``hc_site``'s ``again(streams)`` is the block input again, the same bits (the model drops
    that tensor from its consumers' saves and rebuilds it in the backward), over several collapse programs; it
    runs without autograd and leaves the site's own backward as it was."""
    gen = torch.Generator().manual_seed(5)
    x, fn, base, scale = _site_inputs(23, 4, 24, False, gen)
    wide = torch.promote_types(dtype, torch.float32)
    streams = x.to(DEVICE, dtype).requires_grad_()
    params = [p.to(DEVICE, wide).requires_grad_() for p in (fn, base, scale)]
    kw = dict(norm_weight=(1 + 0.5 * torch.randn(24, dtype=torch.float64, generator=gen)).to(DEVICE, wide),
              rms_eps=1e-5) if norm else {}
    kw["config"] = MhcConfig(collapse_rows=4)  # the reference ignores it
    post, comb, out, _, again = hc_site(streams, *params, sinkhorn_iters=20, hc_eps=EPS, norm_eps=EPS,
                                        backend=backend, **kw)
    plain = hc_pre(streams, *params, sinkhorn_iters=20, hc_eps=EPS, norm_eps=EPS, backend=backend, **kw)
    with torch.enable_grad():
        redo = again(streams.detach().clone())
    assert torch.equal(redo, out) and not redo.requires_grad and redo.is_contiguous()
    cot = [torch.randn(o.shape, dtype=torch.float64, generator=gen).to(DEVICE, o.dtype) for o in (post, comb, out)]
    g1 = torch.autograd.grad((post, comb, out), [streams, *params], cot)
    g2 = torch.autograd.grad(plain, [streams, *params], cot)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("t", [13, 1], ids=["T13", "T1"])
def test_site_streams_take_the_combine_gradient(backend, t):
    """A site and its combine on ``Site.streams`` (the fused path: the combine's stream gradient is added inside the
    site's backward) give every gradient of the site and combine on the plain streams (autograd sums the two), and
    the same outputs; fp64."""
    gen = torch.Generator().manual_seed(t)
    x, fn, base, scale = _site_inputs(t, 4, 24, False, gen)
    y = torch.randn(t, 24, dtype=torch.float64, generator=gen)
    norm_w = 1 + 0.5 * torch.randn(24, dtype=torch.float64, generator=gen)
    cot = torch.randn(t, 4, 24, dtype=torch.float64, generator=gen)
    cot_x = torch.randn(t, 24, dtype=torch.float64, generator=gen)
    results = []
    for fused in (True, False):
        leaves = [v.to(DEVICE).requires_grad_() for v in (x, fn, base, scale, y, norm_w)]
        site = hc_site(*leaves[:4], sinkhorn_iters=20, hc_eps=EPS, norm_eps=EPS, norm_weight=leaves[5], rms_eps=1e-5,
                       backend=backend)
        out = hc_combine(site.streams if fused else leaves[0], leaves[4], site.post, site.comb, backend=backend)
        if fused and backend == "triton":  # the combine's stream gradient goes to the site's node, not the leaf
            assert type(out.grad_fn.next_functions[0][0]).__name__ == "_HcPreBackward"
        loss = (out * cot.to(DEVICE)).sum() + (site.x * cot_x.to(DEVICE)).sum()
        results.append([out.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(loss, leaves))])
    for name, a, b in zip(["out", "streams", "fn", "base", "scale", "y", "norm_weight"], *results):
        assert rel_err(a, b) < 1e-14, f"{name}: {rel_err(a, b):.2e}"


def test_rebuilt_input_hands_its_collapse_to_the_site_backward(monkeypatch):
    """A site whose block input was rebuilt (``again``) before its backward takes that rebuild's collapse instead
    of computing it a second time, and its gradients stay the same bits; without a rebuild it computes it."""
    gen = torch.Generator().manual_seed(9)
    x, fn, base, scale = _site_inputs(11, 4, 24, False, gen)
    norm_w = (1 + 0.5 * torch.randn(24, dtype=torch.float64, generator=gen)).to(DEVICE)
    cot = [torch.randn(s, dtype=torch.float64, generator=gen).to(DEVICE) for s in ((11, 4), (11, 4, 4), (11, 24))]
    calls = []
    real = kernels._collapse_again
    monkeypatch.setattr(kernels, "_collapse_again", lambda *a: calls.append(1) or real(*a))
    grads = []
    for rebuild in (False, True):
        leaves = [v.to(DEVICE).requires_grad_() for v in (x, fn, base, scale)]
        site = hc_site(*leaves, sinkhorn_iters=20, hc_eps=EPS, norm_eps=EPS, norm_weight=norm_w, rms_eps=1e-5,
                       backend="triton")
        if rebuild:
            assert torch.equal(site.again(leaves[0]), site.x)
        calls.clear()
        grads.append(torch.autograd.grad((site.post, site.comb, site.x), leaves, cot))
        assert len(calls) == (0 if rebuild else 1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_norm_weight_shape_is_checked():
    gen = torch.Generator().manual_seed(0)
    x, fn, base, scale = _site_inputs(3, 4, 8, False, gen)
    with pytest.raises(ValueError, match="norm_weight must be"):
        hc_pre(x.to(DEVICE), fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE), sinkhorn_iters=2, hc_eps=EPS,
               norm_eps=EPS, norm_weight=torch.ones(7, dtype=torch.float64, device=DEVICE), backend="triton")


def _run_combine(backend, inputs, dtype, cot, config=None):
    wide = torch.promote_types(dtype, torch.float32)
    x, y, post, comb = inputs
    leaves = [x.to(DEVICE, dtype).requires_grad_(), y.to(DEVICE, dtype).requires_grad_(),
              post.to(DEVICE, wide).requires_grad_(), comb.to(DEVICE, wide).requires_grad_()]
    out = hc_combine(*leaves, backend=backend, config=config)
    grads = torch.autograd.grad((out.double() * cot.to(DEVICE)).sum(), leaves)
    return out.detach().cpu(), [g.cpu() for g in grads]


def _combine_inputs(t, n, d, gen):
    return [torch.randn(t, n, d, dtype=torch.float64, generator=gen), torch.randn(t, d, dtype=torch.float64,
            generator=gen), 2 * torch.rand(t, n, dtype=torch.float64, generator=gen),
            torch.rand(t, n, n, dtype=torch.float64, generator=gen)]


@pytest.mark.parametrize("t,n,d", SIZES + [(0, 4, 8), (3, 4, 300)], ids=SIZE_IDS + ["T0", "D300"])
def test_combine_fp64(t, n, d):
    _check_combine_fp64(t, n, d)


def _check_combine_fp64(t, n, d, config=None):
    gen = torch.Generator().manual_seed(t + n + d)
    inputs = _combine_inputs(t, n, d, gen)
    cot = torch.randn(t, n, d, dtype=torch.float64, generator=gen)
    ref, ref_grads = _run_combine("reference", inputs, torch.float64, cot)
    out, grads = _run_combine("triton", inputs, torch.float64, cot, config)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-13
    for name, g, r in zip(["streams", "block_out", "post", "comb"], grads, ref_grads):
        assert g.shape == r.shape and torch.isfinite(g).all() and rel_err(g, r) < 1e-13, name


def test_combine_bf16():
    """bf16 streams: post / comb rounded to bf16 first (as the reference casts them), the sum in fp32, rounded
    once. The CPU interpreter truncates to bf16 instead of rounding, hence the loose bound here; the GPU test
    below holds the kernel to the bf16 PyTorch error."""
    gen = torch.Generator().manual_seed(5)
    x, y, post, comb = _combine_inputs(8, 4, 24, gen)
    x, y = x.bfloat16().double(), y.bfloat16().double()
    exact = hc_combine_ref(x, y, post.bfloat16().double(), comb.bfloat16().double())
    cot = torch.randn(8, 4, 24, dtype=torch.float64, generator=gen)
    out, grads = _run_combine("triton", [x, y, post, comb], torch.bfloat16, cot)
    assert out.dtype == torch.bfloat16 and rel_err(out, exact) < 1e-2
    assert grads[0].dtype == torch.bfloat16 and grads[2].dtype == torch.float32


# ---------------------------------------------------------------------------------------------- GPU
def _bf16_errors(fn_ref, fn_fused, make_leaves, cot_gen):
    """Relative errors vs fp64 of the bf16 PyTorch reference and of the fused kernels, per output / gradient."""
    exact_leaves = make_leaves(torch.float64)
    exact_outs = fn_ref(*exact_leaves)
    cots = cot_gen(exact_outs)
    exact = list(exact_outs) + list(torch.autograd.grad(
        sum((o * c).sum() for o, c in zip(exact_outs, cots)), exact_leaves))
    errs = {}
    for name, fn in (("torch", fn_ref), ("triton", fn_fused)):
        leaves = make_leaves(torch.bfloat16)
        outs = fn(*leaves)
        grads = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(outs, cots)), leaves)
        errs[name] = [rel_err(a, b) for a, b in zip(list(outs) + list(grads), exact)]
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True], ids=["site", "site_with_norm"])
@pytest.mark.parametrize("head", [False, True], ids=["pre", "head"])
def test_gpu_site_bf16_flash_geometry(head, norm):
    """The fused site (with ``norm``: and the RMSNorm after it) in bf16 within twice the error of the same steps in
    bf16 PyTorch, outputs and every gradient."""
    t, n, d = 4096, 4, 4096
    g = torch.Generator(device="cuda").manual_seed(2 if norm else 0)
    width = n if head else (2 + n) * n
    x = torch.randn(t, n, d, device="cuda", generator=g).bfloat16()
    params = [0.02 * torch.randn(width, n * d, device="cuda", generator=g),
              0.5 * torch.randn(width, device="cuda", generator=g),
              1 + 0.3 * torch.randn(1 if head else 3, device="cuda", generator=g)]
    if norm:
        params.append(1 + 0.3 * torch.randn(d, device="cuda", generator=g))

    def make_leaves(dtype):
        wide = torch.promote_types(dtype, torch.float32)
        return [x.to(dtype).requires_grad_()] + [p.to(wide).requires_grad_() for p in params]

    def run(backend):
        def site(x_, fn, base, scale, *w):
            kw = dict(hc_eps=EPS, norm_eps=EPS, backend=backend)
            if w:
                kw.update(norm_weight=w[0], rms_eps=1e-6)
            if head:
                return (hc_head(x_, fn, base, scale, **kw),)
            return hc_pre(x_, fn, base, scale, sinkhorn_iters=20, **kw)
        return site

    def cots(outs):
        return [torch.randn(o.shape, device="cuda", dtype=torch.float64, generator=g) for o in outs]

    errs = _bf16_errors(run("reference"), run("triton"), make_leaves, cots)
    last = "normed" if norm else "collapsed"
    names = ([last] if head else ["post", "comb", last]) + ["d_streams", "d_fn", "d_base", "d_scale"]
    names += ["d_norm_weight"] if norm else []
    for name, e_ref, e_tri in zip(names, errs["torch"], errs["triton"]):
        assert e_tri <= 2 * e_ref + 1e-6, f"{name}: triton {e_tri:.3e} vs bf16 torch {e_ref:.3e}"


@pytest.mark.gpu
def test_gpu_combine_bf16_flash_geometry():
    t, n, d = 4096, 4, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, n, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    post = 2 * torch.rand(t, n, device="cuda", generator=g)
    comb = torch.rand(t, n, n, device="cuda", generator=g)

    def make_leaves(dtype):
        wide = torch.promote_types(dtype, torch.float32)
        return [x.to(dtype).requires_grad_(), y.to(dtype).requires_grad_(), post.to(wide).requires_grad_(),
                comb.to(wide).requires_grad_()]

    def cots(outs):
        return [torch.randn(o.shape, device="cuda", dtype=torch.float64, generator=g) for o in outs]

    errs = _bf16_errors(lambda *a: (hc_combine(*a, backend="reference"),),
                        lambda *a: (hc_combine(*a, backend="triton"),), make_leaves, cots)
    for name, e_ref, e_tri in zip(["out", "d_streams", "d_block_out", "d_post", "d_comb"], errs["torch"],
                                  errs["triton"]):
        assert e_tri <= 2 * e_ref + 1e-6, f"{name}: triton {e_tri:.3e} vs bf16 torch {e_ref:.3e}"

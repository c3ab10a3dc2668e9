"""The grouped MoE path (csattn/ops/moe) against the per-expert loop: outputs and every gradient (x, routing
weights, gate_up_proj, down_proj) in fp32 against an fp64 run of the loop, bf16 sanity, the Triton SwiGLU and
gather-sum kernels (interpreter on CPU) against their references with NaN-poisoned outputs, routing edge cases
(E up to 256, empty experts, one hot expert, T = 0 and 1), no host read, and what one MoE layer saves.

Tolerance reasoning (fp32 against fp64): both paths compute the same sums in fp32, only in different orders
(grouped GEMM tiles vs per-expert ``F.linear``, the weight applied to the SwiGLU output vs the down-projection
output, an fp32 gather-sum vs ``index_add``), so each is a few fp32 roundings (6e-8) per element away from
fp64. The grouped path may be at most 3x as far from fp64 as the fp32 loop is, with a floor of 1e-6 (about 16
roundings, relative in norm) for the cases where the loop happens to land very close.
"""

from __future__ import annotations

import pytest
import torch

from csattn.models.deepseek_v4.moe import MoE
from csattn.nosync import HostSyncError, NoHostSync
from csattn.ops.moe import expert_load, gather_sum_ref, moe_experts, resolve_backend, swiglu_bwd_ref, swiglu_fwd_ref
from tests.helpers import rel_err
from tests.models.model_utils import tiny_model

LIMIT = 1.5  # small enough that the clamps bind on a good share of the unit-scale activations below


def _problem(t: int, e: int, k: int, d: int = 16, inter: int = 8, seed: int = 0, hot: int | None = None):
    """fp64 leaves ``x [T, D]``, ``weights [T, k]``, ``gate_up [E, 2I, D]``, ``down [E, D, I]``, ids, dout."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    ids = torch.rand(t, e, generator=g).argsort(-1)[:, :k]
    if hot is not None:  # expert `hot` in every token's picks (k = 1: every token on that expert alone)
        ids[:, 0] = hot
        ids[:, 1:] = (hot + 1 + torch.arange(k - 1)) % e
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    gate_up = torch.randn(e, 2 * inter, d, generator=g, dtype=torch.float64) * d ** -0.5 * 2
    down = torch.randn(e, d, inter, generator=g, dtype=torch.float64) * inter ** -0.5
    dout = torch.randn(t, d, generator=g, dtype=torch.float64)
    return (x, w, gate_up, down), ids, dout


def _run(leaves, ids, dout, dtype, backend):
    """Output and the gradients of (x, weights, gate_up_proj, down_proj) in ``dtype``."""
    x, w, gu, dn = (t.detach().to(dtype).requires_grad_() for t in leaves)
    out = moe_experts(x, ids, w, gu, dn, LIMIT, backend=backend)
    grads = torch.autograd.grad(out, (x, w, gu, dn), dout.to(dtype), allow_unused=True)
    return [out.detach(), *grads]


NAMES = ("out", "dx", "dweights", "dgate_up", "ddown")


def _check_vs_fp64(leaves, ids, dout, backend, assert_close):
    exact = _run(leaves, ids, dout, torch.float64, "reference")
    plain = _run(leaves, ids, dout, torch.float32, "reference")
    got = _run(leaves, ids, dout, torch.float32, backend)
    for g, p, x, name in zip(got, plain, exact, NAMES):
        assert g.dtype == torch.float32 and g.shape == x.shape, name
        assert_close(g, x, max(3 * rel_err(p, x), 1e-6), name)
    return got


@pytest.mark.parametrize("e,k,t", [(8, 2, 40), (64, 6, 24), (256, 6, 20)])
def test_grouped_matches_fp64_loop(e, k, t, assert_close):
    leaves, ids, dout = _problem(t, e, k)
    assert resolve_backend("auto", leaves[0].float(), leaves[2].float(), leaves[3].float()) == "grouped"
    got = _check_vs_fp64(leaves, ids, dout, "grouped", assert_close)
    used = torch.zeros(e, dtype=torch.bool)
    used[ids.reshape(-1)] = True
    assert (~used).any() or e == 8  # the larger E leave experts without tokens
    for grad in got[3:]:  # experts without tokens get exact zeros, the others not
        assert torch.count_nonzero(grad[~used]) == 0
        assert (grad[used].flatten(1).abs().amax(1) > 0).all()


def test_triton_backend_matches_fp64_loop(assert_close):
    leaves, ids, dout = _problem(37, 8, 2, inter=136)  # I over one column block of the kernels
    _check_vs_fp64(leaves, ids, dout, "triton", assert_close)


@pytest.mark.parametrize("k", [1, 2])
def test_one_hot_expert(k, assert_close):
    leaves, ids, dout = _problem(30, 8, k, hot=5)
    got = _check_vs_fp64(leaves, ids, dout, "grouped", assert_close)
    if k == 1:  # every token on expert 5: every other expert's gradient is zero
        others = torch.arange(8) != 5
        assert torch.count_nonzero(got[3][others]) == 0 and torch.count_nonzero(got[4][others]) == 0


def test_one_token(assert_close):
    leaves, ids, dout = _problem(1, 64, 6)
    _check_vs_fp64(leaves, ids, dout, "grouped", assert_close)


@pytest.mark.parametrize("backend", ["grouped", "triton"])
def test_no_tokens(backend):
    leaves, ids, dout = _problem(0, 8, 2)
    out, dx, dw, dgu, ddn = _run(leaves, ids, dout, torch.float32, backend)
    assert out.shape == (0, 16) and dx.shape == (0, 16) and dw.shape == (0, 2)
    assert dgu.shape == (8, 16, 16) and ddn.shape == (8, 16, 8)
    assert torch.count_nonzero(dgu) == 0 and torch.count_nonzero(ddn) == 0


def test_bf16_within_twice_the_loop_error():
    leaves, ids, dout = _problem(96, 8, 2, d=64, inter=32, seed=3)
    exact = _run(leaves, ids, dout, torch.float64, "reference")
    plain = _run(leaves, ids, dout, torch.bfloat16, "reference")
    got = _run(leaves, ids, dout, torch.bfloat16, "grouped")
    for g, p, x, name in zip(got, plain, exact, NAMES):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        err, ref = rel_err(g, x), rel_err(p, x)
        assert err <= max(2 * ref, 4e-3), f"{name}: {err:.2e} vs bf16 loop {ref:.2e}"


def test_dispatch():
    x, gu, dn = torch.zeros(4, 16), torch.zeros(8, 16, 16), torch.zeros(8, 16, 8)
    assert resolve_backend("auto", x, gu, dn) == "grouped"
    assert resolve_backend("triton", x, gu, dn) == "triton"
    assert resolve_backend("reference", x, gu, dn) == "reference"
    assert resolve_backend("auto", x.bfloat16(), gu.bfloat16(), dn.bfloat16()) == "grouped"
    # grouped_mm takes no fp64; rows not a multiple of 16 bytes; mixed dtypes: the loop, same math
    assert resolve_backend("grouped", x.double(), gu.double(), dn.double()) == "reference"
    assert resolve_backend("grouped", torch.zeros(4, 18), torch.zeros(8, 16, 18), torch.zeros(8, 18, 8)) == "reference"
    assert resolve_backend("triton", x, gu.bfloat16(), dn) == "reference"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cutlass", x, gu, dn)


# ---------------------------------------------------------------------------------------------- Triton kernels
def _gu_with_edges(n: int, inter: int, g: torch.Generator) -> torch.Tensor:
    gu = torch.randn(n, 2 * inter, generator=g) * 2
    gu[0, :4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])  # gate at / beyond the clamp
    gu[1, inter:inter + 4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])  # up at / beyond both ends
    return gu


def test_swiglu_kernels_match_reference(assert_close):
    from csattn.ops.moe.triton import swiglu_bwd_triton, swiglu_fwd_triton

    g = torch.Generator().manual_seed(4)
    n, inter = 37, 200  # neither a multiple of the 16 x 128 tile
    gu, w, dh = _gu_with_edges(n, inter, g), torch.rand(n, generator=g), torch.randn(n, inter, generator=g)
    h = swiglu_fwd_triton(gu, w, LIMIT, out=torch.full((n, inter), float("nan")))
    assert_close(h, swiglu_fwd_ref(gu.double(), w.double(), LIMIT), 1e-6, "h")
    poisoned = (torch.full_like(gu, float("nan")), torch.full((n, inter), float("nan")),
                torch.full((n,), float("nan")))
    dgu, h2, dw = swiglu_bwd_triton(gu, w, dh, LIMIT, out=poisoned)
    ref = swiglu_bwd_ref(gu.double(), w.double(), dh.double(), LIMIT)
    for got, exact, name in zip((dgu, h2, dw), ref, ("dgu", "h", "dw")):
        assert_close(got, exact, 1e-6, name)
    assert torch.equal(h2, h)  # the backward's recomputed activation is the forward's, bit for bit
    # the clamps' gradient masks agree with the reference at and beyond the limits, not only in norm
    assert torch.equal(dgu == 0, ref[0] == 0)


def test_swiglu_reference_matches_autograd():
    g = torch.Generator().manual_seed(5)
    gu = _gu_with_edges(9, 12, g).double().requires_grad_()
    w = torch.rand(9, generator=g, dtype=torch.float64).requires_grad_()
    dh = torch.randn(9, 12, generator=g, dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    plain = torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT) * w[:, None]
    egu, ew = torch.autograd.grad(plain, (gu, w), dh)
    dgu, h, dw = swiglu_bwd_ref(gu.detach(), w.detach(), dh, LIMIT)
    assert torch.allclose(h, plain, rtol=1e-14, atol=0) and torch.allclose(dgu, egu, rtol=1e-12, atol=1e-15)
    assert torch.allclose(dw, ew, rtol=1e-12, atol=0)


def test_gather_sum_kernel_matches_reference(assert_close):
    from csattn.ops.moe.triton import gather_sum_triton

    g = torch.Generator().manual_seed(6)
    t, k, d = 13, 3, 300
    src = torch.randn(t * k, d, generator=g)
    inv = torch.randperm(t * k, generator=g)
    got = gather_sum_triton(src, inv, k, out=torch.full((t, d), float("nan")))
    assert_close(got, src.double()[inv].view(t, k, d).sum(1), 1e-6, "gather-sum")
    assert torch.equal(gather_sum_ref(src, inv, k), src[inv].view(t, k, d).sum(1))


# ---------------------------------------------------------------------------------------------- host reads
def test_no_host_read():
    leaves, ids, dout = _problem(24, 64, 6)
    x, w, gu, dn = (t.float().requires_grad_() for t in leaves)
    with NoHostSync():
        out = moe_experts(x, ids, w, gu, dn, LIMIT, backend="grouped")
        torch.autograd.backward(out, dout.float())
    assert x.grad is not None and w.grad is not None and gu.grad is not None and dn.grad is not None
    with NoHostSync(), pytest.raises(HostSyncError):  # the checker does see the loop's count read
        moe_experts(x, ids, w, gu, dn, LIMIT, backend="reference")


@pytest.mark.parametrize("hashed", [False, True])
def test_moe_layer_no_host_read_and_load(hashed):
    torch.manual_seed(0)
    moe = MoE(16, 8, 8, 2, 32, hashed, "sqrtsoftplus", 2.5, LIMIT)
    if hashed:
        moe.gate.init_hash_table(torch.Generator().manual_seed(1))
    x = torch.randn(20, 16, requires_grad=True)
    input_ids = torch.randint(0, 32, (20,))
    real = torch.rand(20) > 0.3
    with NoHostSync():
        y = moe(x, input_ids=input_ids, real=real)
        y.sum().backward()
    _, experts = moe.gate(x, input_ids)
    assert moe.last_load.dtype == torch.int64
    assert torch.equal(moe.last_load, torch.bincount(experts[real].reshape(-1), minlength=8))
    assert torch.equal(expert_load(experts, 8), torch.bincount(experts.reshape(-1), minlength=8))


@pytest.mark.parametrize("backend", ["grouped", "reference"])
def test_moe_layer_row_chunks(backend):
    """Row chunks (``chunk_rows``, uneven last chunk) give every row's output and every gradient of one pass (fp64;
    the weight gradients sum the chunks' parts), and keep what one pass keeps: the chunks save views of x."""
    torch.manual_seed(0)
    whole = MoE(16, 8, 8, 2, 32, False, "sqrtsoftplus", 2.5, LIMIT, backend=backend).double()
    parts = MoE(16, 8, 8, 2, 32, False, "sqrtsoftplus", 2.5, LIMIT, backend=backend, chunk_rows=7).double()
    parts.load_state_dict(whole.state_dict())
    x = torch.randn(23, 16, dtype=torch.float64)
    dy = torch.randn(23, 16, dtype=torch.float64)
    results = []
    for moe in (whole, parts):
        xi = x.clone().requires_grad_()
        y = moe(xi)
        grads = torch.autograd.grad((y * dy).sum(), [xi, *moe.parameters()])
        results.append((y.detach(), grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-13, atol=1e-14)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    xb = x.bfloat16().requires_grad_()
    one, chunked = whole.bfloat16(), parts.bfloat16()
    assert _saved_bytes(lambda: chunked(xb), (xb, *chunked.parameters())) <= \
        _saved_bytes(lambda: one(xb), (xb, *one.parameters())) + 3 * 4096


# ---------------------------------------------------------------------------------------------- saved tensors
def _saved_bytes(fn, exclude: tuple[torch.Tensor, ...]) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, total = set(), 0
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def test_saved_tensors_per_token():
    t, d, inter, e, k = 64, 32, 16, 8, 2
    torch.manual_seed(0)
    moe = MoE(d, inter, e, k, 32, False, "sqrtsoftplus", 2.5, LIMIT).bfloat16()
    x = torch.randn(t, d, dtype=torch.bfloat16, requires_grad=True)
    params = tuple(moe.parameters())
    routed = _saved_bytes(lambda: moe.experts(x, *reversed(moe.gate(x))), (x, *params))
    # what the routed experts add (the router's own saves included): per token, the gate/up GEMM output
    # (k x 2I bf16), the sorted weight (k x 2), the token and inverse indices (k x 2 x 8); per layer, the
    # int32 expert offsets and the router's scores and picks (E x (4 + 2) + k x 8 per token at most)
    per_token = k * (2 * inter * 2 + 2 + 16) + e * 6 + k * 8 + 8
    assert routed <= t * per_token + 16 * e, routed
    layer = _saved_bytes(lambda: moe(x), (x, *params))
    loop = MoE(d, inter, e, k, 32, False, "sqrtsoftplus", 2.5, LIMIT, backend="reference").bfloat16()
    loop.load_state_dict(moe.state_dict())
    assert layer < _saved_bytes(lambda: loop(x), (x, *loop.parameters()))  # the loop keeps x[rows], h, ...


# ---------------------------------------------------------------------------------------------- the model
def test_model_grouped_matches_fp64():
    """The whole decoder with the grouped MoE (the fp32 CPU default) against its fp64 run (the loop): logits
    and every gradient no farther from fp64 than 3x the fp32 loop's distance (floor 1e-5). tests/models/test_model_hf.py
    holds the same path against HF itself."""
    from csattn.packing import PackedSeqs

    model = tiny_model("pro", seed=3, hca_ratio=128, hc_mult=2)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (150,), generator=g)
    dy = torch.randn(150, model.config.vocab_size, generator=g, dtype=torch.float64)

    def run(dtype, backend):
        import copy

        m = copy.deepcopy(model).to(dtype)
        for mod in m.modules():
            if hasattr(mod, "backend") and hasattr(mod, "gate_up_proj"):
                mod.backend = backend
        out = m(ids, packed=PackedSeqs.uniform(1, 150))
        (out.logits * dy.to(dtype)).sum().backward()
        return out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    exact, plain, got = run(torch.float64, "auto"), run(torch.float32, "reference"), run(torch.float32, "auto")
    assert rel_err(got[0], exact[0]) <= max(3 * rel_err(plain[0], exact[0]), 1e-5)
    assert set(got[1]) == set(exact[1])
    for name, grad in got[1].items():
        tol = max(3 * rel_err(plain[1][name], exact[1][name]), 1e-5)
        assert rel_err(grad, exact[1][name]) <= tol, name


@pytest.mark.parametrize("backend,device,dtype", [
    ("reference", "cpu", torch.bfloat16), ("grouped", "cpu", torch.bfloat16), ("triton", "cpu", torch.bfloat16),
    pytest.param("auto", "cuda", torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param("auto", "cuda", torch.float16, marks=pytest.mark.gpu),
], ids=["reference", "grouped", "triton", "cuda_bf16", "cuda_fp16"])
def test_autocast_is_the_op_on_its_dtype(backend, device, dtype):
    """Under ``torch.autocast`` the experts take ``x`` and both weights in the autocast dtype (a linear's rule)
    and run with autocast off (the grouped backward recomputes outside it): bit for bit the op on bf16 casts,
    forward and every gradient, which reach the fp32 leaves through the casts."""
    (x, w, gate_up, down), ids, dout = _problem(40, 8, 2, d=16, inter=16)
    ids, dout = ids.to(device), dout.float().to(device)
    fp32 = [t.float().to(device).requires_grad_() for t in (x, w, gate_up, down)]
    low = [t.detach().to(dtype if i != 1 else torch.float32).requires_grad_() for i, t in enumerate(fp32)]
    with torch.autocast(device, dtype=dtype):
        ya = moe_experts(fp32[0], ids, fp32[1], fp32[2], fp32[3], LIMIT, backend)
    yl = moe_experts(low[0], ids, low[1], low[2], low[3], LIMIT, backend)
    assert ya.dtype == dtype and torch.equal(ya, yl)
    (ya.float() * dout).sum().backward()
    (yl.float() * dout).sum().backward()
    for name, a, b in zip(("x", "weights", "gate_up_proj", "down_proj"), fp32, low):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad.float()), name

"""The grouped MoE on the GPU: bf16 at the proxy geometry (D 4096, I 2048, T 4096; E 8 top-2 and E 64 top-6)
within 2x the error of the bf16 per-expert loop (same dtype, plain PyTorch) against fp64, for the output and
every gradient; no device synchronization in the forward or backward; exact zero gradients for experts without
tokens (on recycled, NaN-filled memory); fp32 correct; the Triton kernels in bf16 against fp64."""

from __future__ import annotations

import pytest
import torch

from csattn.models.deepseek_v4.moe import MoE
from csattn.ops.moe import moe_experts, resolve_backend, swiglu_bwd_ref, swiglu_fwd_ref
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

LIMIT = 10.0  # DeepSeek-V4's swiglu_limit
NAMES = ("out", "dx", "dweights", "dgate_up", "ddown")


def _problem(t: int, e: int, k: int, d: int, inter: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, d, device="cuda", generator=g, dtype=torch.float64)
    logits = torch.randn(t, e, device="cuda", generator=g)
    top = torch.topk(logits, k, dim=-1)
    ids, w = top.indices, torch.softmax(top.values.double(), dim=-1) * 2.5
    gate_up = torch.randn(e, 2 * inter, d, device="cuda", generator=g, dtype=torch.float64) * d ** -0.5
    down = torch.randn(e, d, inter, device="cuda", generator=g, dtype=torch.float64) * inter ** -0.5
    dout = torch.randn(t, d, device="cuda", generator=g, dtype=torch.float64)
    return (x, w, gate_up, down), ids, dout


def _run(leaves, ids, dout, dtype, backend):
    x, w, gu, dn = (t.detach().to(dtype).requires_grad_() for t in leaves)
    out = moe_experts(x, ids, w, gu, dn, LIMIT, backend=backend)
    grads = torch.autograd.grad(out, (x, w, gu, dn), dout.to(dtype))
    return [out.detach(), *grads]


def _errors(leaves, ids, dout, dtype, backend, exact):
    return [rel_err(g, x) for g, x in zip(_run(leaves, ids, dout, dtype, backend), exact)]


@pytest.mark.parametrize("e,k", [(8, 2), (64, 6)])
def test_bf16_proxy_within_twice_the_loop(e, k):
    leaves, ids, dout = _problem(4096, e, k, 4096, 2048)
    x, gu, dn = (t.bfloat16() for t in (leaves[0], leaves[2], leaves[3]))
    assert resolve_backend("auto", x, gu, dn) == "triton"
    del x, gu, dn
    exact = _run(leaves, ids, dout, torch.float64, "reference")
    plain = _errors(leaves, ids, dout, torch.bfloat16, "reference", exact)
    got = _errors(leaves, ids, dout, torch.bfloat16, "auto", exact)
    for name, g, p in zip(NAMES, got, plain):
        print(f"E {e} k {k} {name}: grouped {g:.3e}, bf16 loop {p:.3e}")
        assert g <= 2 * p, f"{name}: {g:.3e} > 2 x {p:.3e}"


def test_fp32_matches_fp64_loop():
    # fp32 on CUDA goes through grouped_mm's per-group fallback (it reads the offsets on the host), same math
    leaves, ids, dout = _problem(512, 8, 2, 256, 128, seed=1)
    exact = _run(leaves, ids, dout, torch.float64, "reference")
    plain = _errors(leaves, ids, dout, torch.float32, "reference", exact)
    got = _errors(leaves, ids, dout, torch.float32, "auto", exact)
    for name, g, p in zip(NAMES, got, plain):
        assert g <= max(3 * p, 1e-6), f"{name}: {g:.3e} vs fp32 loop {p:.3e}"


def test_no_device_sync_bf16():
    leaves, ids, dout = _problem(1024, 64, 6, 512, 256, seed=2)
    x, w, gu, dn = (t.bfloat16().requires_grad_() for t in leaves)
    moe = MoE(512, 256, 64, 6, 128, False, "sqrtsoftplus", 2.5, LIMIT).cuda().bfloat16()
    dy = dout.bfloat16()

    def step():
        torch.autograd.backward(moe_experts(x, ids, w, gu, dn, LIMIT, backend="triton"), dy)
        torch.autograd.backward(moe(x.detach().requires_grad_()), dy)

    step()  # compiles the kernels outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_empty_experts_get_zero_gradients_on_dirty_memory():
    leaves, ids, dout = _problem(8, 64, 2, 512, 256, seed=3)
    dirt = torch.full((64 * 512 * 512 * 4,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del dirt  # the caching allocator hands these NaN-filled blocks to the next allocations
    _, _, _, dgu, ddn = _run(leaves, ids, dout, torch.bfloat16, "triton")
    used = torch.zeros(64, dtype=torch.bool, device="cuda")
    used[ids.reshape(-1)] = True
    assert torch.count_nonzero(dgu[~used]) == 0 and torch.count_nonzero(ddn[~used]) == 0
    assert torch.isfinite(dgu).all() and torch.isfinite(ddn).all()


def test_triton_kernels_bf16_within_twice_pytorch():
    from csattn.ops.moe.triton import gather_sum_triton, swiglu_bwd_triton, swiglu_fwd_triton

    g = torch.Generator(device="cuda").manual_seed(4)
    n, inter = 4099, 2048
    gu = (torch.randn(n, 2 * inter, device="cuda", generator=g) * 4).bfloat16()
    w = torch.rand(n, device="cuda", generator=g).bfloat16()
    dh = torch.randn(n, inter, device="cuda", generator=g).bfloat16()
    exact = swiglu_bwd_ref(gu.double(), w.double(), dh.double(), LIMIT)

    def plain_bf16():  # the same steps in bf16 PyTorch, rounding after each op
        gate, up = gu.chunk(2, dim=-1)
        gc, uc = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
        s = torch.sigmoid(gc)
        act = gc * s * uc
        d = dh * w[:, None]
        dg = d * uc * (s * (1 + gc * (1 - s))) * (gate <= LIMIT)
        du = d * (gc * s) * ((up >= -LIMIT) & (up <= LIMIT))
        return torch.cat((dg, du), -1), act * w[:, None], (dh * act).float().sum(-1)

    nan = float("nan")
    h = swiglu_fwd_triton(gu, w, LIMIT, out=torch.full((n, inter), nan, device="cuda", dtype=torch.bfloat16))
    got = swiglu_bwd_triton(gu, w, dh, LIMIT, out=(torch.full_like(gu, nan), torch.full_like(h, nan),
                                                    torch.full((n,), nan, device="cuda")))
    assert torch.equal(got[1], h)
    assert rel_err(h, swiglu_fwd_ref(gu.double(), w.double(), LIMIT)) <= 2 * rel_err(plain_bf16()[1], exact[1])
    for name, a, p, x in zip(("dgu", "h", "dw"), got, plain_bf16(), exact):
        assert rel_err(a, x) <= 2 * rel_err(p, x), name
    src = torch.randn(n * 3, 4096, device="cuda", generator=g).bfloat16()
    inv = torch.randperm(n * 3, device="cuda", generator=g)
    ref = src.double()[inv].view(n, 3, -1).sum(1)
    out = gather_sum_triton(src, inv, 3, out=torch.full((n, 4096), nan, device="cuda", dtype=torch.bfloat16))
    assert rel_err(out, ref) <= 2 * rel_err(src[inv].view(n, 3, -1).sum(1), ref)

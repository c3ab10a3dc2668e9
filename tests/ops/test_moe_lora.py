"""LoRA per routed expert in csattn/ops/moe (``moe_experts(..., gate_up_lora=, down_lora=)``).

Oracles: the reference loop with LoRA against the loop on the merged weights ``W + scale * b @ a`` in fp64 (the
same function of the same leaves, so equal to fp64 rounding; the factors' gradients come through the merge), and
the grouped path in fp32 against the fp64 reference with the tolerance of ``test_moe.py`` (at most 3x the fp32
loop's own error, floor 1e-6), for the output and every gradient: x, routing weights, both weights, the four
factors. Experts without rows get exact zero factor gradients; a frozen base gets none.
"""

from __future__ import annotations

import pytest
import torch

from csattn.ops.moe import ExpertLora, experts_ref, moe_experts
from tests.helpers import rel_err
from tests.ops.test_moe import LIMIT, _problem

NAMES = ("out", "dx", "dweights", "dgate_up", "ddown", "dgu_a", "dgu_b", "ddn_a", "ddn_b")
SCALE_GU, SCALE_DN = 2.0, 0.5


def _factors(e: int, d: int, inter: int, r: int, seed: int = 1):
    """fp64 ``a [E, r, D]``, ``b [E, 2I, r]`` (gate/up) and ``a [E, r, I]``, ``b [E, D, r]`` (down), all nonzero."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, r, d, generator=g, dtype=torch.float64) * d ** -0.5,
            torch.randn(e, 2 * inter, r, generator=g, dtype=torch.float64) * r ** -0.5,
            torch.randn(e, r, inter, generator=g, dtype=torch.float64) * inter ** -0.5,
            torch.randn(e, d, r, generator=g, dtype=torch.float64) * r ** -0.5)


def _run(leaves, factors, ids, dout, dtype, backend, merged=False, frozen=False):
    x, w, gu, dn = (t.detach().to(dtype).requires_grad_(not (frozen and i >= 2)) for i, t in enumerate(leaves))
    ga, gb, da, db = (t.detach().to(dtype).requires_grad_() for t in factors)
    if merged:
        out = experts_ref(x, ids, w, gu + SCALE_GU * gb @ ga, dn + SCALE_DN * db @ da, LIMIT)
    else:
        out = moe_experts(x, ids, w, gu, dn, LIMIT, backend=backend, gate_up_lora=ExpertLora(ga, gb, SCALE_GU),
                          down_lora=ExpertLora(da, db, SCALE_DN))
    wrt = (x, w, ga, gb, da, db) if frozen else (x, w, gu, dn, ga, gb, da, db)
    grads = torch.autograd.grad(out, wrt, dout.to(dtype), allow_unused=True)
    if frozen:
        grads = (*grads[:2], None, None, *grads[2:])
    return [out.detach(), *grads]


@pytest.mark.parametrize("e,k,t", [(8, 2, 24), (16, 4, 12)])
def test_reference_equals_merged_weights_fp64(e, k, t, assert_close):
    leaves, ids, dout = _problem(t, e, k)
    factors = _factors(e, 16, 8, 4)
    got = _run(leaves, factors, ids, dout, torch.float64, "reference")
    want = _run(leaves, factors, ids, dout, torch.float64, "reference", merged=True)
    for g, w, name in zip(got, want, NAMES):
        assert_close(g, w, 1e-12, name)


@pytest.mark.parametrize("e,k,t,r", [(8, 2, 40, 4), (64, 6, 24, 8), (4, 1, 9, 4)])
@pytest.mark.parametrize("backend", ["grouped", "triton"])  # triton: LoRA's rank-r kernels (lora_triton.py) too
def test_grouped_matches_fp64_reference(e, k, t, r, backend, assert_close):
    leaves, ids, dout = _problem(t, e, k)
    factors = _factors(e, 16, 8, r)
    exact = _run(leaves, factors, ids, dout, torch.float64, "reference")
    plain = _run(leaves, factors, ids, dout, torch.float32, "reference")
    got = _run(leaves, factors, ids, dout, torch.float32, backend)
    for g, p, x, name in zip(got, plain, exact, NAMES):
        assert g.dtype == torch.float32 and g.shape == x.shape, name
        assert_close(g, x, max(3 * rel_err(p, x), 1e-6), name)
    used = torch.zeros(e, dtype=torch.bool)
    used[ids.reshape(-1)] = True
    for grad in got[5:]:  # experts without rows: exact zeros; the others not
        assert torch.count_nonzero(grad[~used]) == 0
        assert (grad[used].flatten(1).abs().amax(1) > 0).all()


@pytest.mark.parametrize("backend", ["reference", "grouped", "triton"])
def test_frozen_base(backend, assert_close):
    """The base weights without gradients (frozen, as in LoRA fine-tuning): the factors' gradients unchanged."""
    leaves, ids, dout = _problem(20, 8, 2)
    factors = _factors(8, 16, 8, 4)
    exact = _run(leaves, factors, ids, dout, torch.float64, "reference")
    got = _run(leaves, factors, ids, dout, torch.float32, backend, frozen=True)
    assert got[3] is None and got[4] is None
    for g, x, name in zip(got, exact, NAMES):
        if g is not None:
            assert_close(g, x, 1e-5, name)


def test_zero_b_is_the_base_bit_for_bit():
    """b = 0 (LoRA's initialization): the output equals the op without LoRA bit for bit."""
    leaves, ids, _ = _problem(30, 8, 2)
    x, w, gu, dn = (t.float() for t in leaves)
    ga, gb, da, db = (t.float() for t in _factors(8, 16, 8, 4))
    base = moe_experts(x, ids, w, gu, dn, LIMIT, backend="grouped")
    for backend in ("reference", "grouped"):
        with_lora = moe_experts(x, ids, w, gu, dn, LIMIT, backend=backend, gate_up_lora=ExpertLora(ga, 0 * gb, 2.0),
                                down_lora=ExpertLora(da, 0 * db, 2.0))
        ref = base if backend == "grouped" else moe_experts(x, ids, w, gu, dn, LIMIT, backend="reference")
        assert torch.equal(with_lora, ref), backend


def test_no_tokens_zero_factor_grads():
    leaves, ids, dout = _problem(0, 8, 2)
    got = _run(leaves, _factors(8, 16, 8, 4), ids, dout, torch.float32, "grouped")
    assert got[0].shape == (0, 16)
    for grad, shape in zip(got[5:], [(8, 4, 16), (8, 16, 4), (8, 4, 8), (8, 16, 4)]):
        assert grad.shape == shape and torch.count_nonzero(grad) == 0


def test_unaligned_rank_runs_the_reference(assert_close):
    """r = 3 in fp32 (12-byte rows): grouped_mm cannot take the factors, the loop runs (same math)."""
    leaves, ids, dout = _problem(20, 8, 2)
    factors = _factors(8, 16, 8, 3)
    exact = _run(leaves, factors, ids, dout, torch.float64, "reference")
    got = _run(leaves, factors, ids, dout, torch.float32, "grouped")
    for g, x, name in zip(got, exact, NAMES):
        assert_close(g, x, 1e-5, name)

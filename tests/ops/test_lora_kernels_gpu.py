"""LoRA's Triton kernels for the grouped MoE on the GPU in bf16 (real widths, 256 experts' worth of ragged groups):
the rank-r product through a row index, the factor gradient in both layouts and the low-rank term added in place
against fp64 (one bf16 rounding of an fp32 sum); the MoE with LoRA through them against the fp64 reference, within
the error the torch grouped_mm route has."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.fp8.triton import low_rank_add_triton
from csattn.ops.moe import ExpertLora, moe_experts
from csattn.ops.moe.lora_triton import rank_grad_triton, rank_in_triton
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu
BF16 = 4e-3  # bf16's rounding of the output (relative L2), with room for the fp32 summation


def _groups(counts):
    lo = 0
    for c in counts.tolist():
        yield lo, lo + c
        lo += c


def test_kernels_vs_fp64():
    g = torch.Generator(device="cuda").manual_seed(11)
    e, t, k, d, r = 64, 1024, 6, 4096, 16
    counts = torch.randint(0, 2 * t * k // e, (e,), generator=g, device="cuda")
    counts[3] = 0
    offs = counts.cumsum(0).to(torch.int32)
    n = int(offs[-1])
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    index = torch.randint(0, t, (n + 40,), generator=g, device="cuda")  # 40 rows past offs[-1]
    w = (torch.randn(e, r, d, generator=g, device="cuda") * d ** -0.5).bfloat16().transpose(1, 2)  # a^T, strided
    v = rank_in_triton(x, w, offs, index)
    rows = x.double()[index]
    want = torch.zeros(n + 40, r, dtype=torch.float64, device="cuda")
    for i, (lo, hi) in enumerate(_groups(counts)):
        want[lo:hi] = rows[lo:hi] @ w[i].double()
    assert rel_err(v, want) < BF16 and (v[n:] == 0).all()
    p = torch.randn(n + 40, r, generator=g, device="cuda").bfloat16()
    for transpose, split in ((False, None), (True, None), (False, 4)):  # 4: the rows of a group in parts
        got = rank_grad_triton(p, x, offs, 0.5, index, transpose=transpose, split=split)
        want = torch.stack([0.5 * p[lo:hi].double().T @ rows[lo:hi] for lo, hi in _groups(counts)])
        want = want.transpose(1, 2) if transpose else want
        assert rel_err(got, want) < BF16 and (got[3] == 0).all(), (transpose, split)
    out0 = torch.randn(n + 40, d, generator=g, device="cuda").bfloat16()
    wb = (torch.randn(e, d, r, generator=g, device="cuda") * r ** -0.5).bfloat16()
    got = low_rank_add_triton(out0.clone(), p, wb, 0.75, offs)
    want = out0.double().clone()
    for i, (lo, hi) in enumerate(_groups(counts)):
        want[lo:hi] += 0.75 * p[lo:hi].double() @ wb[i].double().T
    assert rel_err(got, want) < BF16 and torch.equal(got[n:], out0[n:])


def test_moe_lora_through_the_kernels_vs_fp64():
    g = torch.Generator(device="cuda").manual_seed(12)
    t, e, k, d, inter, r = 1024, 32, 6, 1024, 512, 16
    x = torch.randn(t, d, generator=g, device="cuda")
    top = torch.topk(torch.randn(t, e, generator=g, device="cuda"), k, dim=-1)
    ids, w = top.indices, torch.softmax(top.values, -1)
    gu = torch.randn(e, 2 * inter, d, generator=g, device="cuda") * d ** -0.5
    dn = torch.randn(e, d, inter, generator=g, device="cuda") * inter ** -0.5
    f = [torch.randn(s, generator=g, device="cuda") * s[-1] ** -0.5
         for s in ((e, r, d), (e, 2 * inter, r), (e, r, inter), (e, d, r))]
    dout = torch.randn(t, d, generator=g, device="cuda")

    def run(dtype, backend):
        leaves = [v.to(dtype).requires_grad_() for v in (x, w, *f)]
        out = moe_experts(leaves[0], ids, leaves[1], gu.to(dtype), dn.to(dtype), 10.0, backend,
                          gate_up_lora=ExpertLora(leaves[2], leaves[3], 2.0),
                          down_lora=ExpertLora(leaves[4], leaves[5], 0.5))
        return [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]

    exact = run(torch.float64, "reference")
    torch_route = run(torch.bfloat16, "grouped")  # torch's grouped_mm for the rank-r products, gathered rows
    kernels = run(torch.bfloat16, "triton")
    for name, a, b, c in zip(("out", "dx", "dw", "dgu_a", "dgu_b", "ddn_a", "ddn_b"), kernels, torch_route, exact):
        ea, eb = rel_err(a, c), rel_err(b, c)
        print(f"moe lora {name}: kernels {ea:.2e}, grouped_mm {eb:.2e}")
        assert ea <= 1.5 * eb + 1e-3, (name, ea, eb)

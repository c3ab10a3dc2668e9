"""The output head's loss on CUDA: fp32 logits from the GEMM."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_gpu_head_loss_takes_fp32_logits_from_the_gemm():
    """The head's chunked CE on CUDA takes fp32 logits straight from the GEMM (``_WideLogits``): its loss and
    gradients are at least as close to fp64 as the bf16-logits path's (within 2x), on vocab-sized rows."""
    from csattn.models.deepseek_v4.model import _ce_sum, _head_ce_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(8000, 512, device="cuda", generator=g)).bfloat16().requires_grad_()
    labels = torch.randint(0, 8000, (512,), device="cuda", generator=g)
    labels[::7] = -100

    def run(fn, a, b):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        return [loss.detach().double(), a.grad.double(), b.grad.double()]

    ref = run(lambda a, b: _ce_sum(torch.nn.functional.linear(a, b), labels), h.double(), w.double())
    got = run(lambda a, b: _head_ce_sum(a, b, labels), h, w)
    plain = run(lambda a, b: _ce_sum(torch.nn.functional.linear(a, b), labels), h, w)
    for name, x, r, p in zip(["loss", "d_hidden", "d_weight"], got, ref, plain):
        err, base = float((x - r).norm() / r.norm()), float((p - r).norm() / r.norm())
        assert err <= 2 * base + 1e-6, f"{name}: {err:.2e} vs bf16 logits {base:.2e}"

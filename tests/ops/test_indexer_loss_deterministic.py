"""Indexer KL loss with ``deterministic=True``: ``dk`` summed in exact int64 fixed point (csattn/ops/fixed_point.py).

CPU (TRITON_INTERPRET=1): the loss and the gradients of ``q_idx``, ``w`` and ``k_idx`` against the fp64 reference
at the tolerances of ``test_indexer_loss_triton.py``, sparse and dense, and the same bits over two runs. GPU
(``-m gpu``): bf16 at HI = 64, cI = 128, k = 512 with every row picking among a few dozen entries (thousands of rows
adding into each key row), the same bits over five runs, as accurate as the default path.
"""

import pytest
import torch

from csattn.ops.indexer_loss import IndexerLossConfig, indexer_kl_loss
from tests.helpers import poison_kernel_outputs, rel_err
from tests.ops.test_indexer_loss_triton import _case, _run

DET = IndexerLossConfig(deterministic=True)


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    import csattn.ops.indexer_loss.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.indexer_loss.triton)


def _run_det(args, selected, meta, dtype, config=DET):
    q_idx, w, k_idx, q, ckv, lse, scale, row_weight = args
    wide = torch.float32
    leaves = [t.to(dt).clone().requires_grad_() for t, dt in ((q_idx, dtype), (w, wide), (k_idx, dtype))]
    loss = indexer_kl_loss(*leaves, q.to(dtype), ckv.to(dtype), lse.to(wide), scale, row_weight.to(wide),
                           selected=selected, vis_start=meta.vis_start, vis_end=meta.vis_end, backend="triton",
                           config=config)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_deterministic_matches_reference(dense, assert_close):
    gen = torch.Generator().manual_seed(34)
    args, selected, meta = _case([37, 50, 3, 21], [40, 52, 4, 24], 3, 16, 3, 32, 6, gen)
    sel = None if dense else selected
    ref, ref_grads = _run("reference", args, sel, meta, torch.float64)
    runs = [_run_det(args, sel, meta, torch.float32) for _ in range(2)]
    got, grads = runs[0]
    assert_close(got, ref, 1e-5, "loss")
    for name, g, r in zip(("q_idx", "w", "k_idx"), grads, ref_grads):
        assert_close(g, r, 2e-5, f"grad {name}")
    assert torch.equal(runs[0][0], runs[1][0])
    for name, a, b in zip(("q_idx", "w", "k_idx"), runs[0][1], runs[1][1]):
        assert torch.equal(a, b), f"{name}: two runs differ"


@pytest.mark.gpu
def test_gpu_bitwise_with_repeated_entries():
    gen = torch.Generator().manual_seed(5)
    T, HI, CI, H, D, Nc, K = 4096, 64, 128, 64, 512, 40, 512
    dev = "cuda"

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    q_idx, w, k_idx = rnd(T, HI, CI).bfloat16(), rnd(T, HI), rnd(Nc, CI).bfloat16()
    q, ckv = rnd(T, H, D, scale=0.5).bfloat16(), rnd(Nc, D, scale=0.5).bfloat16()
    scale = D**-0.5
    lse = (torch.einsum("thd,nd->thn", q.float(), ckv.float()) * scale).logsumexp(-1) + 0.5
    row_weight = torch.full((T,), 1.0 / T, device=dev)
    selected = torch.randint(0, Nc, (T, K), generator=gen).to(dev)  # repeats within and across rows
    selected[torch.rand(T, K, generator=gen).to(dev) < 0.1] = -1

    def run(config):
        leaves = [t.clone().requires_grad_() for t in (q_idx, w, k_idx)]
        loss = indexer_kl_loss(*leaves, q, ckv, lse, scale, row_weight, selected=selected, backend="triton",
                               config=config)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    runs = [run(DET) for _ in range(5)]
    for r in runs[1:]:
        for name, a, b in zip(("loss", "q_idx", "w", "k_idx"), runs[0], r):
            assert torch.equal(a, b), f"{name}: runs differ"
    default = run(None)
    exact = [t.double() for t in (q_idx, w, k_idx)]
    leaves = [t.clone().requires_grad_() for t in exact]
    loss = indexer_kl_loss(*leaves, q.double(), ckv.double(), lse.double(), scale, row_weight.double(),
                           selected=selected, backend="reference")
    loss.backward()
    for name, a, b, r in zip(("q_idx", "w", "k_idx"), runs[0][1:], default[1:], [t.grad for t in leaves]):
        assert rel_err(a, r) <= 1.5 * rel_err(b, r) + 1e-5, (name, rel_err(a, r), rel_err(b, r))

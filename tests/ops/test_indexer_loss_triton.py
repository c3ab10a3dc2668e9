"""Triton indexer KL loss against ``indexer_kl_loss_ref`` (fp64): the loss and the gradients of ``q_idx``,
``w`` and ``k_idx``, sparse and dense, on ragged packs with padding rows and rows that see nothing."""

import pytest
import torch

from csattn.ops.indexer import indexer_topk_ref
from csattn.ops.indexer_loss import indexer_kl_loss
from csattn.packing import PackedSeqs
from tests.helpers import poison_kernel_outputs, rel_err


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.indexer_loss.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.indexer_loss.triton)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lengths, padded, HI, CI, H, D, topk, gen, dtype=torch.float64):
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=padded)
    dev = torch.device(DEVICE)
    meta = packed.compress(4, device=dev)
    rows = packed.rows(dev)
    T, Nc = packed.num_rows, meta.num_entries

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(DEVICE)

    q_idx, w, k_idx = rnd(T, HI, CI), rnd(T, HI), rnd(Nc, CI)
    q, ckv = rnd(T, H, D, scale=0.5), rnd(Nc, D, scale=0.5)
    scale = D**-0.5
    # A plausible full log-denominator: the teacher logsumexp over all entries plus a window/sink share.
    lse = (torch.einsum("thd,nd->thn", q, ckv) * scale).logsumexp(-1) + 0.5 if Nc else rnd(T, H)
    row_weight = rows.real.double() / rows.num_real
    selected = indexer_topk_ref(q_idx, w, k_idx, meta.vis_start, meta.vis_end, topk)
    return (q_idx, w, k_idx, q, ckv, lse, scale, row_weight), selected, meta


def _run(backend, args, selected, meta, dtype):
    q_idx, w, k_idx, q, ckv, lse, scale, row_weight = args
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # w, lse and row weights stay fp32
    leaves = [t.to(dt).clone().requires_grad_() for t, dt in ((q_idx, dtype), (w, wide), (k_idx, dtype))]
    other = [t.to(dtype) for t in (q, ckv)]
    loss = indexer_kl_loss(*leaves, *other, lse.to(wide), scale,
                           row_weight.to(wide), selected=selected, vis_start=meta.vis_start,
                           vis_end=meta.vis_end, backend=backend)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize(
    "lengths,padded,topk",
    [
        pytest.param([37, 50, 3, 21], [40, 52, 4, 24], 6, id="ragged_padded"),
        pytest.param([9, 30], [12, 30], 40, id="topk_gt_visible"),
    ],
)
def test_loss_matches_reference(lengths, padded, topk, dense, assert_close):
    gen = torch.Generator().manual_seed(len(lengths) * 7 + topk)
    args, selected, meta = _case(lengths, padded, 3, 16, 3, 32, topk, gen)
    sel = None if dense else selected
    ref, ref_grads = _run("reference", args, sel, meta, torch.float64)
    got, grads = _run("triton", args, sel, meta, torch.float32)
    assert got.dtype == torch.float32
    assert_close(got, ref, 1e-5, "loss")
    for name, g, r in zip(("q_idx", "w", "k_idx"), grads, ref_grads):
        assert_close(g, r, 2e-5, f"grad {name}")


def test_loss_no_entries_gives_connected_zero():
    gen = torch.Generator().manual_seed(3)
    args, selected, meta = _case([3, 2], [3, 2], 2, 16, 2, 16, 4, gen)
    got, grads = _run("triton", args, selected, meta, torch.float32)
    assert float(got) == 0.0
    assert all(g is not None and float(g.abs().sum()) == 0.0 for g in grads)


def test_loss_bad_input():
    q_idx = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="dense"):
        indexer_kl_loss(q_idx, torch.zeros(4, 2), torch.zeros(2, 16), torch.zeros(4, 2, 16), torch.zeros(2, 16),
                        torch.zeros(4, 2), 1.0, torch.ones(4), backend="triton")
    with pytest.raises(ValueError, match="lse"):
        indexer_kl_loss(q_idx, torch.zeros(4, 2), torch.zeros(2, 16), torch.zeros(4, 2, 16), torch.zeros(2, 16),
                        torch.zeros(4, 3), 1.0, torch.ones(4), selected=torch.zeros(4, 1, dtype=torch.long),
                        backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_loss_gpu_bf16_real_geometry(dense):
    """bf16 at HI=64, cI=128, H=64, d=512, k=512 on a ragged pack: the kernel's error against the fp64 reference
    is within twice that of the reference run on the same bf16 inputs (bf16 gradients), plus a small floor."""
    gen = torch.Generator().manual_seed(0)
    lengths, padded = ([1500, 127, 5, 2400], [1504, 128, 8, 2400]) if not dense else ([700, 5, 900], [704, 8, 900])
    args, selected, meta = _case(lengths, padded, 64, 128, 64, 512, 512, gen)
    sel = None if dense else selected
    bf = [t.to(torch.bfloat16).double() if t.is_floating_point() and t.dim() > 1 else t for t in args[:5]]
    exact_args = (*bf, args[5], args[6], args[7])
    ref, ref_grads = _run("reference", exact_args, sel, meta, torch.float64)
    same, same_grads = _run("reference", exact_args, sel, meta, torch.bfloat16)
    got, grads = _run("triton", exact_args, sel, meta, torch.bfloat16)
    assert rel_err(got, ref) <= 2 * rel_err(same, ref) + 1e-4
    for name, g, s, r in zip(("q_idx", "w", "k_idx"), grads, same_grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) <= 2 * rel_err(s, r) + 2e-3, (name, rel_err(g, r), rel_err(s, r))


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_layer_triton_matches_reference(layer_type, assert_close):
    """The whole layer on ``backend="triton"`` (compressor, indexer top-k, indexer loss, sparse attention):
    the output and every parameter gradient, the indexer's (trained by the loss only) included."""
    from tests.helpers import grads, random_layer, tiny_config

    if torch.cuda.is_available():
        pytest.skip("fp32 wiring check for the CPU interpreter; on a GPU the per-op bf16 tests apply")
    packed = PackedSeqs.from_lengths([13, 30, 3], padded_lengths=[16, 32, 4])
    results = {}
    for backend in ("reference", "triton"):
        cfg = tiny_config(layer_type, backend=backend)
        layer = random_layer(cfg, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(packed.num_rows, cfg.hidden_size, generator=gen).requires_grad_()
        out = layer(x, packed=packed)
        out.backward(torch.ones_like(out))
        results[backend] = (out.detach(), x.grad, grads(layer))
    (out, dx, g), (ref, ref_dx, ref_g) = results["triton"], results["reference"]
    assert_close(out, ref, 1e-5, "output")
    assert_close(dx, ref_dx, 1e-5, "grad x")
    assert ref_g.keys() == g.keys()
    for name, r in ref_g.items():
        assert (g[name] is None) == (r is None), name
        if r is not None:
            assert_close(g[name], r, 1e-5, f"grad {name}")

"""The block-recomputed core (query heads -> sparse attention -> output projection, ``csattn.layers.core``) and
the block-wise teacher of the sparse indexer loss.

- the core keeps no per-head ``[T, H, d]`` tensor for the backward (the plain path does: checked too, so the
  test can fail);
- the fused (Triton) core and the split loss equal the fp64 reference (interpreter on the CPU), layer level:
  output, input gradient, every parameter gradient and the indexer loss;
- the loss from a teacher filled in blocks equals the one-call indexer loss, value and gradients, both backends.
"""

from __future__ import annotations

import pytest
import torch

from csattn import PackedSeqs
from csattn.layers.modules import Projection, indexer_queries
from csattn.ops.indexer_loss import (
    SparseTeacher,
    StudentQueries,
    indexer_kl_from_teacher,
    indexer_kl_loss,
    sparse_teacher_block,
)
from tests.helpers import grads, random_layer, rel_err, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA, or the interpreter (conftest)
WIDE = dict(num_heads=4, head_dim=16, index_n_heads=4, index_head_dim=8)  # H d = 64 > D = 32 > HI cI


def _saved_numels(layer, x, packed) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, packed=packed)
    return sizes


@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
def test_core_keeps_no_per_head_tensor(layer_type):
    packed = PackedSeqs.from_lengths([23, 5, 40])
    t = 68
    x = torch.randn(t, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    per_head = t * WIDE["num_heads"] * WIDE["head_dim"]
    fused = random_layer(tiny_config(layer_type, workspace_bytes=1 << 12, **WIDE))
    plain = random_layer(tiny_config(layer_type, recompute_projections=False, **WIDE))
    assert max(_saved_numels(plain, x, packed)) >= per_head  # the plain path keeps q and o
    assert max(_saved_numels(fused, x, packed)) < per_head


@pytest.mark.parametrize("loss_type,kept", [("sparse", False), ("dense", True)])
def test_sparse_loss_keeps_no_indexer_queries(loss_type, kept):
    """The sparse indexer loss recomputes ``q_idx [T, HI, cI]`` in its backward; the dense one keeps it (in row
    chunks), so the check can fail."""
    packed = PackedSeqs.from_lengths([23, 5, 40])
    t = 68
    x = torch.randn(t, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    layer = random_layer(tiny_config("csa", workspace_bytes=1 << 12, indexer_loss_type=loss_type, **WIDE))
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, packed=packed)
    # rows of the indexer queries [.., HI, cI] (the dense loss keeps them in row chunks)
    assert any(shape[-2:] == (WIDE["index_n_heads"], WIDE["index_head_dim"]) for shape in shapes) == kept


@pytest.mark.parametrize("layer_type", ["sliding", "csa"])
def test_block_ids_freed_after_the_core_backward(layer_type):
    """While the layer's output is alive (its graph nodes too), the int64 index lists of every row (top-k and
    window ids) must not outlive the core's backward."""
    import gc

    from csattn.report.live_tensors import LiveStorages

    packed = PackedSeqs.from_lengths([23, 5, 40])
    t = 68
    x = torch.randn(t, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    layer = random_layer(tiny_config(layer_type, workspace_bytes=1 << 12, **WIDE))
    with LiveStorages() as live:
        y = layer(x, packed=packed)

    def row_ids():
        gc.collect()
        return [shape for _, shape, dt, _ in live.alive(set()) if dt == "int64" and len(shape) == 2 and shape[0] == t]

    assert row_ids()  # kept for the backward, so the check can fail
    y.square().sum().backward(retain_graph=True)  # a retained graph keeps them for another backward
    first = x.grad.clone()
    assert row_ids()
    x.grad = None
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, first, rtol=1e-13, atol=1e-13)
    assert row_ids() == [] and y.requires_grad


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_fused_core_matches_reference(layer_type):
    pytest.importorskip("triton")
    x = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = {}
    for backend, dtype, device in (("reference", torch.float64, "cpu"), ("triton", torch.float32, DEVICE)):
        cfg = tiny_config(layer_type, backend=backend, workspace_bytes=1 << 12, **WIDE)
        layer = random_layer(cfg).to(device, dtype)
        packed = PackedSeqs.from_lengths([30, 3, 27], [32, 4, 28], device=device)
        xi = x.to(device, dtype).detach().requires_grad_()
        y = layer(xi, packed=packed)
        y.square().sum().backward()
        results[backend] = (y.detach().cpu(), xi.grad.cpu(), {n: None if g is None else g.cpu()
                                                                 for n, g in grads(layer).items()},
                            layer.last_indexer_loss)
    (y0, gx0, g0, l0), (y1, gx1, g1, l1) = results["reference"], results["triton"]
    assert rel_err(y1, y0) < 1e-5 and rel_err(gx1, gx0) < 1e-5
    for name, g in g0.items():
        if g is None:
            assert g1[name] is None or torch.count_nonzero(g1[name]) == 0, name
        else:
            assert rel_err(g1[name], g) < 1e-4, (name, rel_err(g1[name], g))
    if layer_type == "csa":
        assert abs(l1.item() - l0.item()) <= 1e-5 * abs(l0.item()) and l0.item() > 0
        assert torch.count_nonzero(g0["compressor.indexer.q_b_proj.weight"]) > 0


@pytest.mark.parametrize("with_lora", [False, True])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_loss_from_block_teacher_equals_one_call(backend, with_lora):
    """The block-filled teacher plus the loss whose backward recomputes the indexer queries from their latent
    equal one call of the sparse loss on the whole ``q_idx``: value and the gradients of the query weight (or, with
    LoRA, of the frozen weight's pair, run factored), the latent, ``w`` and ``k_idx``."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype = torch.float64 if backend == "reference" else torch.float32
    device = DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(3)
    t, nc, h, d, hi, ci, k, lora = 19, 7, 3, 16, 2, 8, 4, 12
    qr = torch.randn(t, lora, dtype=dtype, generator=g)
    weight = torch.randn(hi * ci, lora, dtype=dtype, generator=g) / lora**0.5
    angle = torch.rand(t, 2, dtype=dtype, generator=g) * 6
    w = torch.randn(t, hi, dtype=dtype, generator=g)
    k_idx = torch.randn(nc, ci, dtype=dtype, generator=g)
    q = torch.randn(t, h, d, dtype=dtype, generator=g)
    ckv = torch.randn(nc, d, dtype=dtype, generator=g)
    lse = torch.randn(t, h, dtype=dtype, generator=g).abs() + 3
    selected = torch.randint(-1, nc, (t, k), generator=g)
    row_weight = (torch.rand(t, generator=g) > 0.2).to(dtype) / t
    pair = (torch.randn(3, lora, dtype=dtype, generator=g) / lora**0.5, torch.randn(hi * ci, 3, dtype=dtype,
                                                                                  generator=g) / 3**0.5)
    qr, w, k_idx = (a.to(device).requires_grad_() for a in (qr, w, k_idx))
    weight = weight.to(device).requires_grad_(not with_lora)  # with LoRA: frozen, the pair learns
    params = (weight, *(a.to(device).requires_grad_() for a in pair)) if with_lora else (weight,)
    q, ckv, lse, selected, row_weight = (a.to(device) for a in (q, ckv, lse, selected, row_weight))
    cos, sin = angle.cos().to(device), angle.sin().to(device)

    def fn(qr, cos, sin, *params):  # the queries' recipe over their params (StudentQueries.params)
        return indexer_queries(qr, cos, sin, Projection.of(params, 0.5), hi)

    scale = d**-0.5
    leaves = (qr, *(p for p in params if p.requires_grad), w, k_idx)
    q_idx = fn(qr, cos, sin, *params)
    ref = indexer_kl_loss(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected=selected, backend=backend)
    ref_grads = torch.autograd.grad(ref, leaves)
    teacher = SparseTeacher(t, k, torch.promote_types(dtype, torch.float32), q.device, backend=backend)
    q_idx = q_idx.detach()
    for lo, hi_ in ((0, 8), (8, 16), (16, t)):
        sparse_teacher_block(teacher, lo, q_idx[lo:hi_], w[lo:hi_], k_idx, q[lo:hi_], ckv, lse[lo:hi_], scale,
                             row_weight[lo:hi_], selected[lo:hi_], backend=backend)
    # small blocks / workspace: the backward recomputes the queries in several blocks
    got = indexer_kl_from_teacher(StudentQueries(fn, qr, cos, sin, params, chunk_rows=8), w, k_idx, teacher,
                                  row_weight, selected, workspace_bytes=4096, backend=backend)
    got_grads = torch.autograd.grad(got, leaves)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(got.item() - ref.item()) <= tol * abs(ref.item()) and ref.item() > 0
    names = ("qr", *(("lora_a", "lora_b") if with_lora else ("weight",)), "w", "k_idx")
    for name, a, b in zip(names, got_grads, ref_grads, strict=True):
        assert rel_err(a, b) <= tol * 10, (name, rel_err(a, b))

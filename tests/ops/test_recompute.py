"""Row-chunked recomputation and rebuilt saves give the same outputs and gradients as plain autograd; rebuilt
saves keep no reference to the dropped tensor and rebuild it once for all its consumers."""

import pytest
import torch

from csattn import PackedSeqs
from csattn.ops.recompute import rebuilt_saves, row_chunked
from tests.helpers import grads, random_layer, tiny_config


def test_row_chunked_matches_autograd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, dtype=torch.float64, generator=g, requires_grad=True)
    s = torch.randn(11, 1, dtype=torch.float64, generator=g)
    w = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda a, b, m: torch.tanh(a @ m.T) * b
    ref = fn(x, s, w)
    dy = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, w), dy)
    out = row_chunked(fn, (x, s), (w,), chunk_rows=4)
    got = torch.autograd.grad(out, (x, w), dy)
    assert torch.allclose(out, ref, rtol=0, atol=1e-15)
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(lambda a, m: row_chunked(fn, (a, s), (m,), chunk_rows=3), (x, w))


@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
def test_layer_recompute_equals_plain(layer_type):
    packed = PackedSeqs.from_lengths([23, 5, 40])
    x = torch.randn(68, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (False, True):
        layer = random_layer(tiny_config(layer_type, recompute_projections=recompute, workspace_bytes=1 << 12))
        assert recompute is False or layer._recompute_rows() < 68  # several blocks
        xi = x.clone().requires_grad_()
        y = layer(xi, packed=packed)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, grads(layer)))
    (y0, gx0, g0), (y1, gx1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-13)
    for n in g0:
        if g0[n] is None:
            assert g1[n] is None or torch.count_nonzero(g1[n]) == 0, n
        else:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-11, atol=1e-13, msg=n)


def test_indexer_queries_in_chunks_equal_one_call():
    """``Indexer.queries(chunk_rows=...)`` (chunks written into the output, recomputed in the backward) gives the
    same queries and gradients as one call."""
    layer = random_layer(tiny_config("csa", index_n_heads=4, index_head_dim=8))
    indexer = layer.compressor.indexer
    g = torch.Generator().manual_seed(5)
    qr = torch.randn(70, 16, dtype=torch.float64, generator=g, requires_grad=True)
    angle = torch.rand(70, 4, dtype=torch.float64, generator=g) * 6
    cos, sin = angle.cos(), angle.sin()
    dy = torch.randn(70, 4, 8, dtype=torch.float64, generator=g)
    results = []
    for chunk in (None, 16):
        q = indexer.queries(qr, cos, sin, chunk_rows=chunk)
        results.append((q.detach(), *torch.autograd.grad(q, (qr, indexer.q_b_proj.weight), dy)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def _consumers(x, w1, w2):
    """Three consumers that each save ``x`` or a view of it: a matmul, a reshaped matmul, an elementwise product."""
    a = torch.tanh(x @ w1)
    b = x.view(-1, 2, x.shape[1] // 2)[:, 1] @ w2
    c = x[1:] * x[1:].sin()
    return a.sum() + b.square().sum() + c.sum()


def test_rebuilt_saves_matches_autograd_and_keeps_nothing_of_x():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w1 = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    make = lambda s: (s * 2).exp()  # noqa: E731
    ref = torch.autograd.grad(_consumers(make(src), w1, w2), (src, w1, w2))
    calls = []

    def again():
        calls.append(1)
        return make(src.detach())

    x = make(src)
    ptr = x.untyped_storage().data_ptr()
    saved = []
    with rebuilt_saves(x, again):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            pass  # the innermost hooks win: nothing here
        loss = _consumers(x, w1, w2)
    got = torch.autograd.grad(loss, (src, w1, w2), retain_graph=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert len(calls) == 1  # one rebuild for every consumer
    # nothing in the graph holds x's storage: only make's own save (exp keeps its output) and the consumers'
    # other tensors; x is rebuilt
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        x2 = make(src)
        with rebuilt_saves(x2, again):
            _consumers(x2, w1, w2)
    # the outer hooks see only what the inner ones let through: exp's output (saved outside the inner scope)
    assert held.count(x2.untyped_storage().data_ptr()) == 1
    assert ptr != 0


def test_rebuilt_saves_refuses_a_wrong_rebuild_and_passes_through_otherwise():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = x * 1.0
    with rebuilt_saves(y, lambda: torch.zeros(3, 4, dtype=torch.float64)):
        loss = (y * y).sum()
    with pytest.raises(RuntimeError, match="rebuilt_saves"):
        loss.backward()
    # no rebuild: a null context (again None, a view that does not own its storage, autograd off)
    for view in (False, True):
        z = x * 1.0
        with rebuilt_saves(z[1:] if view else z, (lambda z=z: z[1:]) if view else None):
            (z * z).sum().backward()
    assert torch.equal(x.grad, 4 * x.detach())
    with torch.no_grad(), rebuilt_saves(x * 1.0, lambda: x):
        assert not torch.is_grad_enabled()

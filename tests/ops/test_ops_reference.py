"""The reference ops: gradcheck (fp64), tie breaking, chunking invariance, empty rows."""

import pytest
import torch
from torch.autograd import gradcheck

from csattn import PackedSeqs
from csattn.ops.compressor import compress_pool_ref
from csattn.ops.indexer import indexer_scores_ref, indexer_topk_ref
from csattn.ops.indexer_loss import indexer_kl_loss_ref
from csattn.ops.indices import window_indices
from csattn.ops.rope import YarnScaling, apply_rope, rope_cos_sin, rope_inv_freq
from csattn.ops.sparse_attn import sparse_attn_ref

D = torch.float64


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_rope_gradcheck_and_inverse():
    inv = rope_inv_freq(8, 160000.0, YarnScaling(factor=4, original_max_position_embeddings=32))
    cos, sin = rope_cos_sin(torch.arange(5), inv, D)
    x = torch.randn(5, 3, 12, dtype=D, generator=_g(), requires_grad=True)
    assert gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    back = apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True)
    # tables are fp32 (like the reference model), so cos^2 + sin^2 = 1 only to fp32 rounding
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)
    assert torch.equal(apply_rope(x, cos, sin)[..., :4], x[..., :4])


def test_yarn_changes_only_low_frequencies():
    plain = rope_inv_freq(64, 160000.0)
    yarn = rope_inv_freq(64, 160000.0, YarnScaling())
    assert torch.equal(plain[:4], yarn[:4])  # fast-rotating pairs are extrapolated unchanged
    torch.testing.assert_close(yarn[-1], plain[-1] / 16)  # slow pairs are interpolated by the factor


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 4), (False, 3)])
def test_compressor_gradcheck(overlap, ratio):
    packed = PackedSeqs.from_lengths([9, 2, 13])
    meta = packed.compress(ratio)
    coff = 2 if overlap else 1
    kv = torch.randn(24, coff * 3, dtype=D, generator=_g(1), requires_grad=True)
    gate = torch.randn(24, coff * 3, dtype=D, generator=_g(2), requires_grad=True)
    bias = torch.randn(ratio, coff * 3, dtype=D, generator=_g(3), requires_grad=True)
    fn = lambda a, b, c: compress_pool_ref(a, b, c, meta.entry_row, meta.entry_first, ratio, overlap)
    assert fn(kv, gate, bias).shape == (meta.num_entries, 3)
    assert gradcheck(fn, (kv, gate, bias))


def test_compressor_overlap_first_block_and_slots():
    # a single entry with no previous block equals the plain pool of its second-half channels
    kv = torch.randn(4, 6, dtype=D, generator=_g())
    gate = torch.randn(4, 6, dtype=D, generator=_g(1))
    bias = torch.randn(4, 6, dtype=D, generator=_g(2))
    row, first = torch.tensor([0]), torch.tensor([True])
    got = compress_pool_ref(kv, gate, bias, row, first, 4, True)
    ref = compress_pool_ref(kv[:, 3:], gate[:, 3:], bias[:, 3:], row, first, 4, False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-15)


def test_indexer_scores_and_topk_gradcheck():
    q = torch.randn(3, 2, 4, dtype=D, generator=_g(), requires_grad=True)
    w = torch.randn(3, 2, dtype=D, generator=_g(1), requires_grad=True)
    k = torch.randn(5, 4, dtype=D, generator=_g(2), requires_grad=True)
    assert gradcheck(indexer_scores_ref, (q, w, k))


def test_topk_ties_go_to_lower_id_and_pad():
    q = torch.zeros(3, 1, 2, dtype=D)  # every score is 0: all ties
    w = torch.ones(3, 1, dtype=D)
    k = torch.randn(6, 2, dtype=D)
    vis_start = torch.tensor([0, 0, 2])
    vis_end = torch.tensor([0, 4, 6])
    got = indexer_topk_ref(q, w, k, vis_start, vis_end, topk=3)
    assert got.tolist() == [[-1, -1, -1], [0, 1, 2], [2, 3, 4]]


def test_topk_lists_ids_ascending():
    """The picked ids come in ascending order, not by score: scores 5, 1, 2, 6 pick ids 0 and 3 as [0, 3]."""
    q = torch.ones(1, 1, 1, dtype=D)
    w = torch.ones(1, 1, dtype=D)
    k = torch.tensor([[5.0], [1.0], [2.0], [6.0]], dtype=D)
    got = indexer_topk_ref(q, w, k, torch.tensor([0]), torch.tensor([4]), topk=2)
    assert got.tolist() == [[0, 3]]


def test_topk_chunking_does_not_change_selection():
    packed = PackedSeqs.from_lengths([50, 7, 61])
    meta = packed.compress(4)
    q = torch.randn(118, 3, 8, dtype=D, generator=_g())
    w = torch.randn(118, 3, dtype=D, generator=_g(1))
    k = torch.randn(meta.num_entries, 8, dtype=D, generator=_g(2))
    big = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, 5)
    small = indexer_topk_ref(q, w, k, meta.vis_start, meta.vis_end, 5, workspace_bytes=1)
    assert torch.equal(big, small)
    assert (big >= 0).sum() > 0 and (big == -1).sum() > 0
    valid = big >= 0
    assert bool(((big >= meta.vis_start[:, None]) & (big < meta.vis_end[:, None]) | ~valid).all())


def _sparse_inputs():
    q = torch.randn(5, 2, 6, dtype=D, generator=_g(), requires_grad=True)
    kv = torch.randn(7, 6, dtype=D, generator=_g(1), requires_grad=True)
    sink = torch.randn(2, dtype=D, generator=_g(2), requires_grad=True)
    idx = torch.tensor([[0, 1, -1], [2, -1, 6], [-1, -1, -1], [3, 3, 5], [4, 0, 1]])
    return q, kv, sink, idx


def test_sparse_attn_gradcheck_and_empty_row():
    q, kv, sink, idx = _sparse_inputs()
    fn = lambda a, b, c: sparse_attn_ref(a, b, idx, c, 0.4, chunk_rows=2)
    assert gradcheck(fn, (q, kv, sink))
    o, lse = fn(q, kv, sink)
    assert torch.count_nonzero(o[2]) == 0
    torch.testing.assert_close(lse[2], sink.detach())


def test_sparse_attn_matches_dense_softmax_with_sink():
    q, kv, sink, idx = _sparse_inputs()
    o, lse = sparse_attn_ref(q, kv, idx, sink, 0.4)
    for t in range(5):
        keys = [j for j in idx[t].tolist() if j >= 0]
        if not keys:
            continue
        s = torch.einsum("hd,kd->hk", q[t], kv[keys]) * 0.4
        full = torch.cat([s, sink[:, None]], dim=1).softmax(dim=1)
        torch.testing.assert_close(o[t], full[:, :-1] @ kv[keys], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_indexer_loss_gradcheck(dense):
    q_idx = torch.randn(6, 2, 4, dtype=D, generator=_g(), requires_grad=True)
    w = torch.randn(6, 2, dtype=D, generator=_g(1), requires_grad=True)
    k_idx = torch.randn(4, 4, dtype=D, generator=_g(2), requires_grad=True)
    q = torch.randn(6, 3, 5, dtype=D, generator=_g(3))
    ckv = torch.randn(4, 5, dtype=D, generator=_g(4))
    lse = torch.randn(6, 3, dtype=D, generator=_g(5)).abs() + 2
    sel = torch.tensor([[0, -1], [1, 0], [-1, -1], [2, 3], [3, 1], [0, 2]])
    vis_start = torch.tensor([0, 0, 0, 2, 2, 2])
    vis_end = torch.tensor([1, 2, 0, 4, 4, 3])
    rw = torch.full((6,), 1 / 6, dtype=D)
    fn = lambda a, b, c: indexer_kl_loss_ref(a, b, c, q, ckv, lse, 0.5, rw, selected=None if dense else sel,
                                             vis_start=vis_start, vis_end=vis_end, workspace_bytes=64)
    assert gradcheck(fn, (q_idx, w, k_idx))


def test_window_indices():
    pos = torch.tensor([0, 1, 2, 0, 1])
    real = torch.tensor([True, True, True, True, False])
    got = window_indices(pos, real, 2)
    assert got.tolist() == [[-1, 0], [0, 1], [1, 2], [-1, 3], [-1, -1]]


def test_row_gathers_backward_the_same_bits_with_threads():
    """The references' row gathers (``take_rows``: the compressor's slots, the sparse attention's keys) sum the
    gradients of repeated rows in one order: the same bits on every run with two threads (advanced indexing's backward,
    ``index_put_(accumulate=True)``, gave last-bit differences between runs on the CPU, which broke the bitwise resume
    of ``csattn train``)."""
    from csattn.ops.indices import gather_rows_masked, take_rows

    table = torch.randn(50, 64, generator=_g(3), requires_grad=True)
    ids = torch.randint(-1, 50, (4000, 3), generator=_g(4))
    grad = torch.randn(4000, 3, 64, generator=_g(5))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for gather in (take_rows, gather_rows_masked):
            runs = [torch.autograd.grad(gather(table, ids.clamp(min=0) if gather is take_rows else ids), table, grad)[0]
                    for _ in range(8)]
            assert all(torch.equal(runs[0], r) for r in runs[1:]), gather.__name__
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(take_rows(table, ids.clamp(min=0)), table[ids.clamp(min=0)])

"""Indexer KL loss: brute-force per-row equality, gradient routing, coefficient and loss scale."""

import pytest
import torch

from csattn import PackedSeqs
from tests.helpers import random_layer, tiny_config


def brute_force_loss(layer, x, lengths, dense: bool):
    """Per-row loops straight from the definition, on one layer's own projections."""
    cfg = layer.config
    packed = PackedSeqs.from_lengths(lengths)
    rows = packed.rows()
    meta = packed.compress(cfg.compress_ratio)
    cos, sin = layer._rope_tables(rows.pos, x.dtype)
    q, qr = layer._queries(x, cos, sin)
    kv = layer._raw_kv(x, cos, sin)
    ckv = layer.compressor.compress(x, meta, layer.inv_freq)
    idx = layer.compressor.indexer
    k_idx = idx.compress(x, meta, layer.inv_freq)  # not detached here: we differentiate the loss by hand
    q_idx = idx.queries(qr.detach(), cos, sin)
    w = idx.scorer(x.detach())
    total = x.new_zeros(())
    for t in range(x.shape[0]):
        b, p = int(rows.doc[t]), int(rows.pos[t])
        first = int(meta.cu_comp[b])
        n_vis = min((p + 1) // cfg.compress_ratio, int(meta.cu_comp[b + 1]) - first)
        if n_vis == 0:
            continue
        scores = torch.stack([(w[t] * (q_idx[t] @ k_idx[first + i]).relu()).sum() for i in range(n_vis)])
        order = sorted(range(n_vis), key=lambda i: (-float(scores[i].detach()), i))[: cfg.index_topk]
        window = [t - j for j in range(min(cfg.sliding_window, p + 1))]
        logits_w = torch.stack([q[t].detach() @ kv[j].detach() for j in window], dim=1) * cfg.scale  # [H, W]
        logits_c = torch.stack([q[t].detach() @ ckv[first + i].detach() for i in order], dim=1) * cfg.scale
        lse = torch.logsumexp(torch.cat([logits_w, logits_c, layer.sinks.detach()[:, None]], dim=1), dim=1)
        cand = list(range(n_vis)) if dense else order
        teacher = torch.stack(
            [torch.exp(q[t].detach() @ ckv[first + i].detach() * cfg.scale - lse).sum() for i in cand])
        teacher = teacher / teacher.sum()
        log_p = torch.log_softmax(scores[cand], dim=0)
        total = total + (teacher * (teacher.log() - log_p)).sum()
    return total / x.shape[0]


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_loss_and_grads_equal_brute_force(dense, assert_close):
    lengths = [23, 3, 30]
    layer = random_layer(tiny_config("csa", indexer_loss_type="dense" if dense else "sparse",
                                     indexer_loss_coeff=1.0))
    x = torch.randn(sum(lengths), 32, dtype=torch.float64)
    layer.zero_grad()
    layer(x, packed=PackedSeqs.from_lengths(lengths)).sum().backward()
    got_loss = layer.last_indexer_loss
    got = {n: p.grad.clone() for n, p in layer.named_parameters() if ".indexer." in n}

    layer.zero_grad()
    ref_loss = brute_force_loss(layer, x, lengths, dense)
    ref_loss.backward()
    ref = float(ref_loss.detach())
    assert abs(float(got_loss) - ref) <= 1e-12 * abs(ref)
    assert ref > 1e-3  # a real, non-trivial loss
    for n, g in got.items():
        assert_close(g, layer.get_parameter(n).grad, 1e-10, n)


def _indexer_and_trunk_grads(coeff, scale=1.0, compute=True):
    layer = random_layer(tiny_config("csa", indexer_loss_coeff=coeff, compute_indexer_loss=compute))
    x = torch.randn(40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layer(x, indexer_loss_scale=scale).square().sum().backward()
    idx = {n: p.grad for n, p in layer.named_parameters() if ".indexer." in n}
    trunk = {n: p.grad for n, p in layer.named_parameters() if ".indexer." not in n}
    return idx, trunk


def test_coefficient_zero_gives_existing_zero_grads():
    idx, _ = _indexer_and_trunk_grads(0.0)
    assert idx and all(g is not None and torch.count_nonzero(g) == 0 for g in idx.values())


def test_lm_loss_sends_no_gradient_into_indexer():
    idx, trunk_without = _indexer_and_trunk_grads(1.0, compute=False)
    assert all(g is None for g in idx.values())
    _, trunk_with = _indexer_and_trunk_grads(1.0)
    for n, g in trunk_without.items():  # the indexer loss does not leak into the trunk either
        assert torch.equal(g, trunk_with[n]), n


def test_loss_scale_and_coefficient_scale_indexer_grads():
    base, _ = _indexer_and_trunk_grads(1.0)
    half, _ = _indexer_and_trunk_grads(1.0, scale=0.5)
    half_tensor, _ = _indexer_and_trunk_grads(1.0, scale=torch.tensor(0.5))  # read in the backward
    triple, _ = _indexer_and_trunk_grads(3.0)
    for n, g in base.items():
        assert torch.count_nonzero(g) > 0, n
        torch.testing.assert_close(half[n], 0.5 * g, rtol=1e-12, atol=0)
        assert torch.equal(half_tensor[n], half[n]), n
        torch.testing.assert_close(triple[n], 3.0 * g, rtol=1e-12, atol=1e-300)

"""A packed THD run equals running each document alone (outputs, input grads, parameter grads, loss)."""

import pytest
import torch

from csattn import PackedSeqs
from tests.helpers import grads, random_layer, tiny_config

PACKS = {
    "ragged": ([13, 1, 2, 3, 29, 8, 17], None),
    "short_docs": ([1, 2, 3, 1], None),
    "padded": ([11, 3, 20, 5], [16, 4, 24, 8]),
    "padded_empty_real": ([9, 0, 7], [12, 4, 8]),
}


@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("pack", list(PACKS), ids=list(PACKS))
def test_packed_equals_per_document(layer_type, pack, assert_close):
    real, padded = PACKS[pack]
    phys = padded or real
    layer = random_layer(tiny_config(layer_type))
    total = sum(phys)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(total, 32, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(total, 32, generator=g, dtype=torch.float64)
    packed = PackedSeqs.from_lengths(real, padded)
    rows = packed.rows()

    layer.zero_grad()
    y = layer(x, packed=packed)
    (y * dy * rows.real[:, None]).sum().backward()
    packed_grads = grads(layer)
    packed_loss = layer.last_indexer_loss

    # per document: only its real rows
    ref_y = torch.zeros_like(y)
    ref_gx = torch.zeros_like(x)
    ref_grads = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}
    ref_loss = 0.0
    start = 0
    n_real = sum(real)
    for r, p in zip(real, phys):
        if r:
            xd = x.detach()[start:start + r].clone().requires_grad_()
            layer.zero_grad()
            # the indexer loss is a mean over real rows: rescale each document's share to the global mean
            yd = layer(xd, indexer_loss_scale=r / n_real)
            (yd * dy[start:start + r]).sum().backward()
            ref_y[start:start + r] = yd.detach()
            ref_gx[start:start + r] = xd.grad
            for n, q in layer.named_parameters():
                if q.grad is not None:
                    ref_grads[n] += q.grad
            if layer.last_indexer_loss is not None:
                ref_loss += float(layer.last_indexer_loss) * r / n_real
        start += p

    real_rows = rows.real
    assert_close(y[real_rows], ref_y[real_rows], 1e-12, "output")
    assert torch.count_nonzero(y[~real_rows]) == 0, "padding rows must output zeros"
    assert_close(x.grad, ref_gx, 1e-12, "input grad")  # padding rows get exactly zero grad
    assert torch.count_nonzero(x.grad[~real_rows]) == 0
    for n, ref in ref_grads.items():
        got = packed_grads[n]
        if torch.count_nonzero(ref) == 0:
            assert got is None or torch.count_nonzero(got) == 0, n
        else:
            assert_close(got, ref, 1e-11, f"grad {n}")
    if layer_type == "csa":
        assert abs(float(packed_loss) - ref_loss) <= 1e-12 * max(1.0, abs(ref_loss))


def test_padding_content_changes_nothing():
    layer = random_layer(tiny_config("csa"))
    packed = PackedSeqs.from_lengths([10, 6], [12, 8])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 32, generator=g, dtype=torch.float64)
    y1 = layer(x, packed=packed)
    x2 = x.clone()
    x2[~packed.rows().real] = 1e3 * torch.randn(int((~packed.rows().real).sum()), 32, generator=g,
                                                 dtype=torch.float64)
    y2 = layer(x2, packed=packed)
    assert torch.equal(y1, y2)


def test_megatron_packed_seq_params_duck_typing():
    from types import SimpleNamespace

    layer = random_layer(tiny_config("hca"))
    packed = PackedSeqs.from_lengths([9, 17], [12, 20])
    x = torch.randn(32, 32, dtype=torch.float64)
    params = SimpleNamespace(cu_seqlens_q=packed.cu_seqlens, cu_seqlens_q_padded=packed.cu_seqlens_padded,
                             max_seqlen_q=20)
    assert torch.equal(layer(x, packed=params), layer(x, packed=packed))
    only_padded = SimpleNamespace(cu_seqlens_q=None, cu_seqlens_q_padded=packed.cu_seqlens_padded,
                                  max_seqlen_q=None)
    assert torch.equal(layer(x, packed=only_padded), layer(x, packed=PackedSeqs.from_lengths([12, 20])))


def test_batch_layout_equals_packed():
    layer = random_layer(tiny_config("csa"))
    x = torch.randn(3, 21, 32, dtype=torch.float64)
    y = layer(x)
    y_packed = layer(x.reshape(63, 32), packed=PackedSeqs.from_lengths([21, 21, 21]))
    assert torch.equal(y.reshape(63, 32), y_packed)

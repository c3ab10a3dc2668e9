"""Capture-safe mode: static metadata from device cu_seqlens, a forward/backward without host syncs, and one
traced function reused on packs with different document boundaries (CPU, fp64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from csattn import PackedSeqs
from csattn.capture_safe import (
    CaptureSafePackedSeqs,
    HostSyncError,
    NoHostSync,
    compressed_capacity,
    indexer_kl_loss_dense_capture_safe,
    indexer_topk_capture_safe,
)
from csattn.ops.indexer import indexer_topk
from csattn.ops.indexer_loss import indexer_kl_loss
from tests.helpers import layer_step, random_layer, tiny_config

# (real lengths, padded lengths); every pack of one group has the same T, number of documents and max_seqlen
PACKS = {
    "ragged": ([13, 1, 2, 3, 29, 8, 17], None),
    "padded": ([11, 3, 20, 5], [16, 4, 24, 8]),
    "padded_empty_real": ([9, 0, 7], [12, 4, 8]),
    "one_doc": ([37], None),
}


def _static(real, padded, max_seqlen=None):
    packed = PackedSeqs.from_lengths(real, padded)
    t = int(packed.cu_seqlens_padded[-1])
    return packed, CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=t,
                                    max_seqlen=max_seqlen or packed.max_seqlen)


@pytest.mark.parametrize("pack", list(PACKS), ids=list(PACKS))
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_static_meta_matches_packed(pack, ratio):
    packed, static = _static(*PACKS[pack])
    rows, srows = packed.rows(), static.rows()
    for name in ("doc", "pos", "real", "doc_start", "real_len"):
        assert torch.equal(getattr(rows, name), getattr(srows, name)), name
    assert int(srows.num_real) == rows.num_real
    meta, smeta = packed.compress(ratio), static.compress(ratio)
    n = meta.num_entries
    assert smeta.capacity == compressed_capacity(static.num_rows, static.num_docs, static.max_seqlen, ratio) >= n
    assert int(smeta.num_entries) == n
    assert smeta.max_visible >= meta.max_visible
    for name in ("cu_comp", "vis_start", "vis_end"):
        assert torch.equal(getattr(meta, name), getattr(smeta, name)), name
    for name in ("entry_row", "entry_first", "entry_pos"):
        assert torch.equal(getattr(meta, name), getattr(smeta, name)[:n]), name
    # tail slots: harmless (row 0, a first entry), invalid, and outside every visible range
    assert not smeta.entry_valid[n:].any() and smeta.entry_valid[:n].all()
    assert (smeta.entry_row[n:] == 0).all() and smeta.entry_first[n:].all()
    assert int(smeta.vis_end.max()) <= n


def test_static_meta_has_no_host_sync():
    _, static = _static(*PACKS["padded"])
    with NoHostSync():
        static.rows()
        static.compress(4)
    with NoHostSync(), pytest.raises(HostSyncError):
        PackedSeqs.from_lengths([5, 3]).compress(4)


def test_no_host_sync_mode_catches_syncs():
    x = torch.arange(6)
    with NoHostSync():
        for bad in (lambda: int(x.sum()), lambda: x.tolist(), lambda: x[x > 2], lambda: x.nonzero(),
                    lambda: x.sum().item()):
            with pytest.raises(HostSyncError):
                bad()
        picked = x[torch.tensor([1, 2])]  # an int index has a static shape
    assert torch.equal(picked, torch.tensor([1, 2]))


def test_static_packed_errors():
    cu = torch.tensor([0, 4, 9])
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        CaptureSafePackedSeqs(cu, torch.tensor([0, 9]), num_rows=9, max_seqlen=5)
    with pytest.raises(ValueError, match="max_seqlen"):
        CaptureSafePackedSeqs(cu, num_rows=9, max_seqlen=-1)
    with pytest.raises(ValueError, match="num_rows"):
        CaptureSafePackedSeqs(cu, num_rows=9.0, max_seqlen=5)
    with pytest.raises(ValueError, match="max_seqlen"):
        CaptureSafePackedSeqs(cu, num_rows=9, max_seqlen=4).check()
    with pytest.raises(ValueError, match="max_seqlen"):
        CaptureSafePackedSeqs.from_packed(PackedSeqs(cu_seqlens=cu), num_rows=9)
    layer = random_layer(tiny_config("csa", capture_safe=True))
    with pytest.raises(ValueError, match="num_rows"):
        layer(torch.randn(8, 32, dtype=torch.float64), packed=CaptureSafePackedSeqs(cu, num_rows=9, max_seqlen=5))
    with pytest.raises(ValueError, match="cp="):
        layer(torch.randn(9, 32, dtype=torch.float64), packed=CaptureSafePackedSeqs(cu, num_rows=9, max_seqlen=5),
              cp=object())


@pytest.mark.parametrize("pack", ["ragged", "padded"])
def test_static_topk_and_dense_loss_match_reference(pack, assert_close):
    packed, static = _static(*PACKS[pack])
    meta, smeta = packed.compress(4), static.compress(4)
    t, n, cap = static.num_rows, meta.num_entries, smeta.capacity
    g = torch.Generator().manual_seed(5)
    q = torch.randn(t, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(t, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k_full = torch.randn(cap, 8, generator=g, dtype=torch.float64)
    k = k_full[:n].clone().requires_grad_()
    k_cap = k_full.clone().requires_grad_()
    for topk in (2, 5, 40):
        ref = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, topk)
        # a tiny workspace forces several chunks
        got = indexer_topk_capture_safe(q, w, k_cap, smeta.vis_start, smeta.vis_end, topk, smeta.max_visible,
                                  workspace_bytes=2048)
        assert torch.equal(ref, got), topk
    qa = torch.randn(t, 2, 16, generator=g, dtype=torch.float64)
    ckv = torch.randn(cap, 16, generator=g, dtype=torch.float64)
    lse = torch.randn(t, 2, generator=g, dtype=torch.float64).abs() + 3
    rw = packed.rows().real.double() / packed.rows().num_real
    ref = indexer_kl_loss(q, w, k, qa, ckv[:n], lse, 0.25, rw, vis_start=meta.vis_start, vis_end=meta.vis_end)
    ref_g = torch.autograd.grad(ref, (q, w, k))
    got = indexer_kl_loss_dense_capture_safe(q, w, k_cap, qa, ckv, lse, 0.25, rw, smeta.vis_start, smeta.vis_end,
                                       smeta.max_visible, workspace_bytes=4096)
    got_g = torch.autograd.grad(got, (q, w, k_cap))
    assert_close(got, ref, 1e-12, "dense loss")
    for name, a, b in zip(("q", "w"), got_g, ref_g):
        assert_close(a, b, 1e-12, name)
    assert_close(got_g[2][:n], ref_g[2], 1e-12, "k")
    assert not got_g[2][n:].any(), "tail slots must get no gradient"


def _compare(got, ref, assert_close, tol=1e-12):
    assert set(got) == set(ref)
    for name in ref:
        assert_close(got[name], ref[name], tol, name)


CASES = [("sliding", {}), ("csa", {}), ("csa", {"indexer_loss_type": "dense"}), ("hca", {}),
         ("csa", {"recompute_projections": False, "workspace_bytes": 4096, "attn_chunk_rows": 7})]


@pytest.mark.parametrize("layer_type,extra,pack", [
    *[(lt, ex, pk) for lt, ex in CASES[:4] for pk in PACKS],
    (*CASES[4], "padded"),
], ids=[*[f"{n}-{pk}" for n in ("W", "CSA", "CSA_dense", "HCA") for pk in PACKS], "CSA_small_chunks-padded"])
def test_capture_safe_equals_default(layer_type, extra, pack, assert_close):
    cfg = tiny_config(layer_type, **extra)
    layer = random_layer(cfg)
    real, padded = PACKS[pack]
    packed, static = _static(real, padded)
    t = static.num_rows
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, 32, generator=g, dtype=torch.float64)
    dy = torch.randn(t, 32, generator=g, dtype=torch.float64)
    ref, ref_loss = layer_step(layer, x, dy, packed)
    layer.config = dataclasses.replace(cfg, capture_safe=True)
    for p in (static, packed):  # a CaptureSafePackedSeqs, or a PackedSeqs turned into one
        got, loss = layer_step(layer, x, dy, p)
        _compare(got, ref, assert_close)
        if ref_loss is not None:
            assert_close(loss, ref_loss, 1e-12, "indexer loss")


@pytest.mark.parametrize("layer_type,extra", [("sliding", {}), ("csa", {}), ("csa", {"indexer_loss_type": "dense"}),
                                              ("hca", {})], ids=["W", "CSA", "CSA_dense", "HCA"])
def test_capture_safe_has_no_host_sync(layer_type, extra, monkeypatch):
    cfg = tiny_config(layer_type, capture_safe=True, workspace_bytes=4096, **extra)
    layer = random_layer(cfg)
    _, static = _static(*PACKS["padded"])
    x = torch.randn(static.num_rows, 32, dtype=torch.float64, requires_grad=True)

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("torch.utils.checkpoint saves the RNG state, which CUDA graph capture forbids")

    import csattn.ops.indexer_loss.capture_safe
    import csattn.ops.indexer_loss.naive
    import csattn.ops.sparse_attn.naive

    for module in (csattn.ops.indexer_loss.capture_safe, csattn.ops.indexer_loss.naive, csattn.ops.sparse_attn.naive):
        monkeypatch.setattr(module, "checkpoint", no_checkpoint)
    with NoHostSync():
        y = layer(x, packed=static)
        y.square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
    # the default path does sync (the check can fail)
    layer.config = dataclasses.replace(cfg, capture_safe=False)
    packed = PackedSeqs(static.cu_seqlens, static.cu_seqlens_padded, static.max_seqlen)
    if layer_type != "sliding":
        with NoHostSync(), pytest.raises(HostSyncError):
            layer(x, packed=packed)


@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_capture_safe_batch_and_single_document_input(layer_type, assert_close):
    cfg = tiny_config(layer_type)
    layer = random_layer(cfg)
    g = torch.Generator().manual_seed(2)
    for shape in ((2, 19, 32), (23, 32)):  # [B, S, D], and [T, D] without packed= (one document)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        dy = torch.randn(*shape, generator=g, dtype=torch.float64)
        layer.config = cfg
        ref, _ = layer_step(layer, x, dy, None)
        layer.config = dataclasses.replace(cfg, capture_safe=True)
        got, _ = layer_step(layer, x, dy, None)
        assert got["y"].shape == x.shape
        _compare(got, ref, assert_close)


@pytest.mark.parametrize("scale", [0.25, torch.tensor(0.25, dtype=torch.float64)], ids=["number", "tensor"])
def test_capture_safe_keeps_the_indexer_loss_scale(scale, assert_close):
    cfg = tiny_config("csa")
    layer = random_layer(cfg)
    packed, static = _static(*PACKS["padded"])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(static.num_rows, 32, generator=g, dtype=torch.float64)
    dy = torch.randn(static.num_rows, 32, generator=g, dtype=torch.float64)
    ref, _ = layer_step(layer, x, dy, packed, indexer_loss_scale=scale)
    got, _ = layer_step(layer, x, dy, static, indexer_loss_scale=scale)
    unscaled, _ = layer_step(layer, x, dy, static)
    _compare(got, ref, assert_close)
    name = "compressor.indexer.q_b_proj.weight"  # trained by the indexer loss only
    assert_close(got[name], 0.25 * unscaled[name], 1e-12, name)



@pytest.mark.parametrize("layer_type,extra", [("csa", {"indexer_loss_type": "dense"}), ("hca", {})],
                         ids=["CSA_dense", "HCA"])
def test_capture_safe_with_lora_equals_default(layer_type, extra, assert_close):
    """LoRA on the projections the layer reads: the default path runs the terms factored, the capture-safe custom ops
    (the dense loss's unblocked heads) take them merged; outputs and every factor's gradient agree (fp64)."""
    from torch import nn

    from csattn.finetune.lora import LoraSpec, add_lora, init_lora, lora_modules

    cfg = tiny_config(layer_type, **extra)
    layer = random_layer(cfg)
    root = nn.Module()  # the names add_lora adapts: model.layers.<i>.self_attn.*
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].self_attn = layer
    for p in layer.parameters():
        p.requires_grad_(False)
    assert add_lora(root, LoraSpec(4, 8.0, 0.0, ("attention", "indexer")))
    init_lora(root, 0)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for _, m in lora_modules(root):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g, dtype=m.lora_B.dtype) * 0.3)
    packed, static = _static(*PACKS["padded"])
    x = torch.randn(static.num_rows, 32, generator=g, dtype=torch.float64)
    dy = torch.randn(static.num_rows, 32, generator=g, dtype=torch.float64)
    ref, _ = layer_step(layer, x, dy, packed)
    assert any(".lora_A" in n for n in ref) and not any(n.endswith("q_b_proj.weight") for n in ref)
    layer.config = dataclasses.replace(cfg, capture_safe=True)
    got, _ = layer_step(layer, x, dy, static)
    _compare(got, ref, assert_close)

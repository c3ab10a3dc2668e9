"""Capture-safe mode on ``backend="triton"``: the static-chunk indexer top-k gives the reference ids, and the
layer's capture-safe forward/backward equals its default Triton path (CPU interpreter, or CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from csattn import PackedSeqs
from csattn.capture_safe import CaptureSafePackedSeqs, indexer_topk_capture_safe
from csattn.ops.indexer import indexer_topk_ref
from tests.helpers import grads, random_layer, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "lengths,padded,topk,workspace",
    [
        pytest.param([37, 58, 5, 23], [40, 60, 8, 24], 6, 1 << 30, id="ragged_padded_ties"),
        pytest.param([64, 3], [64, 3], 32, 1 << 30, id="topk_gt_visible"),
        pytest.param([50, 0, 29], [52, 4, 29], 5, 1, id="tiny_workspace_chunks"),
    ],
)
@pytest.mark.parametrize("streamed", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["row_in_registers", "row_streamed"])
def test_static_topk_triton_equals_reference(lengths, padded, topk, workspace, streamed):
    from csattn.ops.indexer import IndexerConfig

    config = IndexerConfig(register_row=8) if streamed else None
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=padded, device=DEVICE)
    t = packed.num_rows
    static = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=t, max_seqlen=max(padded))
    meta, smeta = packed.compress(4), static.compress(4)
    gen = torch.Generator().manual_seed(sum(lengths) + topk)
    # small integers: exact scores in any summation order, and many ties (the lower-id rule)
    q = torch.randint(-2, 3, (t, 3, 16), generator=gen).float().to(DEVICE)
    w = torch.randint(-2, 3, (t, 3), generator=gen).float().to(DEVICE)
    k = torch.randint(-1, 2, (smeta.capacity, 16), generator=gen).float().to(DEVICE)
    expected = indexer_topk_ref(q, w, k[: meta.num_entries], meta.vis_start, meta.vis_end, topk)
    got = indexer_topk_capture_safe(q, w, k, smeta.vis_start, smeta.vis_end, topk, smeta.max_visible,
                              workspace_bytes=workspace, backend="triton", config=config)
    assert torch.equal(got, expected)


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_capture_safe_layer_triton_equals_default(layer_type, assert_close):
    if torch.cuda.is_available():
        pytest.skip("fp32 wiring check for the CPU interpreter; tests/capture_safe/test_graphs_gpu.py covers the GPU")
    packed = PackedSeqs.from_lengths([13, 30, 3], padded_lengths=[16, 32, 4])
    results = {}
    for capture_safe in (False, True):
        cfg = tiny_config(layer_type, backend="triton", capture_safe=capture_safe)
        layer = random_layer(cfg, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(packed.num_rows, cfg.hidden_size, generator=gen).requires_grad_()
        out = layer(x, packed=packed)
        out.backward(torch.ones_like(out))
        results[capture_safe] = (out.detach(), x.grad, grads(layer), layer.last_indexer_loss)
    (out, dx, g, loss), (ref, ref_dx, ref_g, ref_loss) = results[True], results[False]
    assert_close(out, ref, 1e-6, "output")
    assert_close(dx, ref_dx, 1e-6, "grad x")
    assert ref_g.keys() == g.keys()
    for name, r in ref_g.items():
        assert (g[name] is None) == (r is None), name
        if r is not None:
            assert_close(g[name], r, 1e-6, f"grad {name}")
    if ref_loss is not None:
        assert_close(loss, ref_loss, 1e-6, "indexer loss")


def test_config_replace_keeps_default_path():
    cfg = tiny_config("csa")
    assert not cfg.capture_safe and dataclasses.replace(cfg, capture_safe=True).capture_safe

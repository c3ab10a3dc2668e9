"""``torch.compile(fullgraph=True)`` of the capture-safe layer: no graph break, one compiled function reused on
packs with different document boundaries (same T, number of documents and max_seqlen), forward and backward
equal to the default eager path (CPU, fp64, backend ``aot_eager``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from csattn import PackedSeqs
from csattn.capture_safe import CaptureSafePackedSeqs
from tests.helpers import layer_step, random_layer, tiny_config

# one traced function replayed on each: T = 52, 3 documents, max_seqlen 24
REPLAY = [
    ([20, 9, 13], [24, 12, 16]),
    ([3, 24, 17], [4, 24, 24]),
    ([21, 0, 22], [24, 4, 24]),
]

MAX_SEQLEN = 24
CASES = {
    "W": ("sliding", {}),
    "CSA": ("csa", {}),
    "CSA_dense_no_recompute": ("csa", {"indexer_loss_type": "dense", "recompute_projections": False}),
    "HCA": ("hca", {}),
}


# HCA stays in the fast lane; the other three compile for a minute each on a small CPU
@pytest.mark.parametrize("case", [c if c == "HCA" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_compiled_layer_reused_on_three_packs(case, assert_close):
    layer_type, extra = CASES[case]
    cfg = tiny_config(layer_type, **extra)
    layer = random_layer(cfg)
    static_cfg = dataclasses.replace(cfg, capture_safe=True)
    packs = [PackedSeqs.from_lengths(real, padded) for real, padded in REPLAY]
    t = int(packs[0].cu_seqlens_padded[-1])

    def step(x, cu, cu_pad):
        return layer(x, packed=CaptureSafePackedSeqs(cu, cu_pad, num_rows=t, max_seqlen=MAX_SEQLEN))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(21)
    for i, packed in enumerate(packs):
        x = torch.randn(t, 32, generator=g, dtype=torch.float64)
        dy = torch.randn(t, 32, generator=g, dtype=torch.float64)
        layer.config = cfg
        ref, ref_loss = layer_step(layer, x, dy, packed)
        layer.config = static_cfg
        got, loss = layer_step(layer, x, dy, packed)  # eager capture-safe path
        cu = (packed.cu_seqlens, packed.cu_seqlens_padded)
        comp, _ = layer_step(layer, x, dy, run=lambda xc, cu=cu: compiled(xc, *cu))
        assert set(comp) == set(ref) == set(got)
        for name in ref:
            assert_close(got[name], ref[name], 1e-12, f"pack {i} eager capture-safe {name}")
            assert_close(comp[name], ref[name], 1e-12, f"pack {i} compiled {name}")
        if ref_loss is not None:
            assert_close(loss, ref_loss, 1e-12, f"pack {i} indexer loss")
            assert_close(layer.last_indexer_loss, ref_loss, 1e-12, f"pack {i} compiled indexer loss")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for {len(packs)} packs"

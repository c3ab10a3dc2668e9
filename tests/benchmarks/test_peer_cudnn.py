"""csattn's kernels against NVIDIA's cuDNN Frontend DSA kernels on the same inputs (GPU, when
``nvidia-cudnn-frontend`` with its CuTe-DSL runtime is installed: ``pip install 'csattn[peers]'``):

- the sparse-attention backward: csattn's Triton / Gluon backward and cuDNN's, from the same ``q``, ``kv``, ``o``,
  ``dO`` and index lists, agree to bf16 rounding: each within twice the other's distance from the fp64 gradients;
- the indexer top-k: the same selected sets except where scores tie within fp32 rounding.

The benchmark providers (``benchmarks/providers/cudnn.py``) run the same wrappers, so what is timed is what is
checked here."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


def _dsa():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN's DSA kernels need an SM90+ GPU")
    pytest.importorskip("cudnn.deepseek_sparse_attention", reason="nvidia-cudnn-frontend (csattn[peers]) missing")


def test_sparse_attention_backward_agrees_with_cudnn():
    _dsa()
    from benchmarks.providers.cudnn import CudnnBackward, valid_prefix
    from benchmarks.providers.sparse_attn import packed_indices
    from csattn.ops.sparse_attn import sparse_attn, sparse_attn_ref

    T, H, d, W, k = 2048, 64, 512, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx, N = packed_indices(T, 0, W, k, 4, "cuda", gen)
    q = torch.randn(T, H, d, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(N, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(H, device="cuda", generator=gen)
    do = torch.randn(T, H, d, device="cuda", generator=gen).bfloat16()
    scale = d**-0.5

    def grads(fn, dtype):
        leaves = [q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_(), sink.clone().requires_grad_()]
        o = fn(*leaves)
        return torch.autograd.grad(o, leaves, do.to(dtype))

    exact = grads(lambda a, b, s: sparse_attn_ref(a, b, idx.long(), s, scale)[0], torch.float64)
    ours = grads(lambda a, b, s: sparse_attn(a, b, idx, s, scale, backend="triton")[0], torch.bfloat16)
    # cuDNN over every tile, and told each row's valid prefix (the benchmark's cudnn[len])
    for length in (None, valid_prefix(idx)):
        peer = grads(lambda a, b, s, n=length: CudnnBackward.apply(a, b, idx, s, scale, n)[0], torch.bfloat16)
        for name, e, a, b in zip(["dq", "dkv", "dsink"], exact, ours, peer):
            err_ours, err_peer = rel_err(a, e), rel_err(b, e)
            assert err_ours <= 2 * err_peer + 1e-6 and err_peer <= 2 * err_ours + 1e-6, (name, err_ours, err_peer)
            assert rel_err(a, b) <= 2 * max(err_ours, err_peer) + 1e-6, name


def test_indexer_topk_agrees_with_cudnn():
    _dsa()
    from benchmarks.providers.cudnn import cudnn_indexer_topk, cudnn_segments
    from benchmarks.providers.indexer import _meta
    from csattn.ops.indexer import indexer_scores_ref, indexer_topk

    T, HI, CI, topk = 4096, 64, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(1)
    packed, meta = _meta(T, 2048, 4, "cuda")
    q = torch.randn(T, HI, CI, device="cuda", generator=gen).bfloat16()
    w = torch.randn(T, HI, device="cuda", generator=gen) * (CI * HI) ** -0.5
    k = torch.randn(meta.num_entries, CI, device="cuda", generator=gen).bfloat16()
    ours = indexer_topk(q, w, k, meta.vis_start, meta.vis_end, topk, backend="triton")
    peer = cudnn_indexer_topk(q, w, k, meta, cudnn_segments(packed, meta), topk, 4)
    same = (ours.sort(dim=1).values == peer.sort(dim=1).values).all(dim=1)
    # rows whose sets differ may differ only by ties: the scores of the ids one side picked and the other did not
    # are equal within fp32 rounding of the row's k-th score
    for row in torch.nonzero(~same).flatten().tolist()[:64]:
        a, b = set(ours[row].tolist()) - {-1}, set(peer[row].tolist()) - {-1}
        ids = torch.tensor(sorted(a ^ b), device="cuda")
        s = indexer_scores_ref(q[row:row + 1].float(), w[row:row + 1], k[ids].float()[None])[0]
        kth = indexer_scores_ref(q[row:row + 1].float(), w[row:row + 1], k[ours[row][ours[row] >= 0]].float()[None])
        assert (s - kth.min()).abs().max() <= 1e-5 * kth.abs().max() + 1e-6, row
    assert same.float().mean() >= 0.99

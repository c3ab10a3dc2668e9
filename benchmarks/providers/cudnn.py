"""Provider ``cudnn`` for ``--op sparse_attn`` (the backward) and ``--op indexer_topk``: NVIDIA's cuDNN Frontend
DeepSeek sparse-attention kernels (``cudnn.deepseek_sparse_attention``, CuTe-DSL, PyPI ``nvidia-cudnn-frontend``
1.32; ``pip install 'csattn[peers]'``) on the same inputs as the ``triton`` provider, so one run times both.

- ``sparse_attn``: the forward is csattn's (cuDNN's sparse forward is SM100-only); the backward is cuDNN's SM90 /
  SM100 ``sparse_attention_backward_wrapper`` on the same ``q``, ``kv``, ``o``, ``dO`` and index lists. cuDNN takes
  the KV-only natural-log LSE and adds the sink itself: from csattn's sink-inclusive LSE,
  ``lse_kv = lse + log(-expm1(sink - lse))``. ``--mode bwd`` times cuDNN's backward; ``fwd`` is csattn's forward.
- ``indexer_topk``: ``indexer_forward_wrapper`` (dense fp32 scores ``[T, max_seqlen_k]`` per document, THD) then
  ``indexer_top_k_wrapper`` (radix top-k, ties to the smaller column) over each row's visible prefix; the
  document-local ids are made global like csattn's. ``indexer_select``: the top-k alone, over dense scores
  computed once beforehand (beside csattn's selection alone).

Skipped, with the reason, where the package or an SM90+ GPU is missing. On a machine without a package index the
wheels travel with the checkout (``lab/results_session.sh``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import Case, Skip, register
from .indexer import TOPK_DEFAULTS, topk_inputs
from .sparse_attn import DEFAULTS, attn_inputs


def dsa():
    """The ``cudnn.deepseek_sparse_attention.DSA`` namespace, or a :class:`Skip` saying what is missing."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise Skip("cuDNN's DSA kernels need an SM90+ GPU")
    try:
        from cudnn.deepseek_sparse_attention import DSA
    except ImportError as e:
        raise Skip(f"cuDNN Frontend's DSA module is not importable ({e}): pip install 'csattn[peers]', or the "
                   "bundles of ../shared/peers/make_bundles.sh where there is no package index") from e
    return DSA


def kv_only_lse(lse: Tensor, sink: Tensor) -> Tensor:
    """``log(sum_keys exp(s))`` from ``lse = log(exp(sink) + sum_keys exp(s))`` ``[T, H]`` and ``sink [H]``."""
    return lse + torch.log(-torch.expm1(sink.float()[None, :] - lse))


class CudnnBackward(torch.autograd.Function):
    """csattn's sparse-attention forward, cuDNN's backward (for ``q [T, H, d]``, ``kv [N, d]``, int32 ``idx [T, K]``
    with -1 for no key, ``sink [H]`` fp32). Returns ``(o, lse)``; only ``o`` carries a gradient."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float, length: Tensor | None):
        from csattn.ops.sparse_attn.triton import sparse_attn_fwd

        o, lse = sparse_attn_fwd(q, kv, idx, sink, scale)
        ctx.save_for_backward(q, kv, idx, sink, o, lse)
        ctx.scale = scale
        ctx.length = length
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do: Tensor, _dlse: Tensor | None):
        q, kv, idx, sink, o, lse = ctx.saved_tensors
        res = dsa().sparse_attention_backward_wrapper(q, kv, o, do.contiguous(), kv_only_lse(lse, sink),
                                                      sink.float(), idx, softmax_scale=ctx.scale,
                                                      topk_length=ctx.length)
        return res["dq"], res["dkv"], None, res["d_sink"].to(sink.dtype), None, None


def valid_prefix(idx: Tensor) -> Tensor:
    """``[T]`` int32: 1 + the position of each row's last id >= 0 (0 for none), the ``topk_length`` that lets a
    kernel stop at a row's last valid key without changing its result."""
    pos = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=torch.int32)
    return torch.where(idx >= 0, pos, 0).amax(1).to(torch.int32)


@register("sparse_attn", "cudnn", DEFAULTS)
def sparse_attn_cudnn(shape, device, dtype, variant=""):
    """variant ``len``: cuDNN is also given each row's valid prefix as ``topk_length`` (computed once, untimed), so
    it skips the tiles of ``-1`` after a row's last id as csattn's kernels find for themselves."""
    dsa()
    if variant not in ("", "len"):
        raise Skip(f"the cudnn provider takes the variant 'len' or none, got {variant!r}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise Skip("cuDNN's DSA backward takes bf16 / fp16")
    q, kv, sink, idx, flops, info = attn_inputs(shape, device, dtype)
    scale = shape["dim"] ** -0.5
    length = valid_prefix(idx) if variant == "len" else None

    def forward():
        return CudnnBackward.apply(q, kv, idx, sink, scale, length)

    return Case(forward=forward, leaves=[q, kv, sink], flops=flops, info={**info, "forward": "csattn (triton)"})


def cudnn_segments(packed, meta) -> tuple[Tensor, Tensor, int, int]:
    """The THD layout cuDNN's indexer takes, from csattn's metadata (no host read): ``cu_seqlens_q`` (the
    documents' rows), ``cu_seqlens_k`` (their entries, ``meta.cu_comp``), ``max_seqlen_q``, ``max_seqlen_k``."""
    device = meta.vis_start.device
    cu_q = packed.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    return cu_q, meta.cu_comp.to(torch.int32), int(packed.max_seqlen), max(int(meta.max_visible), 1)


def cudnn_indexer_scores(q: Tensor, w: Tensor, k: Tensor, segments, ratio: int) -> Tensor:
    """cuDNN's dense fp32 scores ``[T, max_seqlen_k]`` per document; ``segments`` from :func:`cudnn_segments`."""
    cu_q, cu_k, max_q, max_k = segments
    return dsa().indexer_forward_wrapper(q.contiguous(), k[:, None].contiguous(), w.contiguous(), ratio=ratio,
                                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                         max_seqlen_k=max_k)["scores"]


def cudnn_select(scores: Tensor, meta, topk: int) -> Tensor:
    """cuDNN's radix top-k over each row's visible prefix of ``scores``: document-local ids, -1 = none."""
    visible = (meta.vis_end - meta.vis_start).to(torch.int32)
    return dsa().indexer_top_k_wrapper(scores, visible, topk, next_n=1, return_val=False, tie_break=1)["indices"]


def cudnn_indexer_topk(q: Tensor, w: Tensor, k: Tensor, meta, segments, topk: int, ratio: int) -> Tensor:
    """``[T, topk]`` global entry ids (-1 = none) from cuDNN's dense scores and radix top-k over each row's
    visible prefix; ``segments`` from :func:`cudnn_segments`."""
    local = cudnn_select(cudnn_indexer_scores(q, w, k, segments, ratio), meta, topk)
    return torch.where(local >= 0, local.long() + meta.vis_start[:, None], -1)


@register("indexer_topk", "cudnn", TOPK_DEFAULTS)
def topk_cudnn(shape, device, dtype, variant=""):
    dsa()
    if variant:
        raise Skip(f"the cudnn provider takes no variant, got {variant!r}")
    packed, meta, q, w, k, flops, info = topk_inputs(shape, device, dtype)
    segments = cudnn_segments(packed, meta)

    def forward():
        return (cudnn_indexer_topk(q, w, k, meta, segments, shape["topk"], shape["ratio"]),)

    return Case(forward=forward, leaves=[], flops=flops, info=info)


@register("indexer_select", "cudnn", TOPK_DEFAULTS)
def select_cudnn(shape, device, dtype, variant=""):
    dsa()
    if variant:
        raise Skip(f"the cudnn provider takes no variant, got {variant!r}")
    packed, meta, q, w, k, _, info = topk_inputs(shape, device, dtype)
    scores = cudnn_indexer_scores(q, w, k, cudnn_segments(packed, meta), shape["ratio"])

    def forward():
        return (cudnn_select(scores, meta, shape["topk"]),)

    info["bytes"] = {"fwd": 4.0 * info["visible_pairs"]}
    return Case(forward=forward, leaves=[], flops={}, info=info)

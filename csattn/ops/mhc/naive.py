"""Plain-PyTorch mHC (manifold-constrained hyper-connections): the numerics of Hugging Face's
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and the oracle of the Triton kernels' tests.

The weights are computed in fp32 (fp64 for fp64 streams) from the RMS-normalized, flattened streams; the
combine casts ``post`` / ``comb`` to the stream dtype first, as HF does. Autocast changes none of it (its GEMMs
run with autocast off), so the fused kernels, the reference and a site rebuilt in the backward agree under it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...amp import autocast_off

__all__ = ["hc_pre_ref", "hc_head_ref", "hc_combine_ref", "sinkhorn_ref"]


def _flat_normed(streams: Tensor, eps: float) -> Tensor:
    """``[T, n, D]`` -> ``[T, n*D]`` fp32 (fp64 for fp64 input), divided by its RMS (no weight)."""
    compute = torch.promote_types(streams.dtype, torch.float32)
    flat = streams.flatten(-2).to(compute)
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def sinkhorn_ref(logits: Tensor, iters: int, eps: float) -> Tensor:
    """``[..., n, n]`` logits -> softmax over the last dim + eps, then Sinkhorn-Knopp: columns first, then
    ``iters - 1`` rounds of rows and columns (each divided by its sum + eps)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre_ref(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, sinkhorn_iters: int, hc_eps: float,
               norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """One mHC site's weights and collapsed block input.

    Args:
        streams: ``[T, n, D]``. fn: ``[(2+n)*n, n*D]``. base: ``[(2+n)*n]``. scale: ``[3]`` (pre, post, comb).

    Returns:
        ``post [T, n]``, ``comb [T, n, n]`` (fp32, fp64 for fp64 streams) and ``collapsed [T, D]`` (stream dtype).
    """
    n = streams.shape[-2]
    flat = _flat_normed(streams, norm_eps)
    with autocast_off(flat):
        mix = F.linear(flat, fn.to(flat.dtype))
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    base = base.to(flat.dtype)
    scale = scale.to(flat.dtype)
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n:2 * n])
    comb = sinkhorn_ref(comb_w.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n), sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
    return post, comb, collapsed


def hc_head_ref(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float) -> Tensor:
    """Final collapse (sigmoid weights, no Sinkhorn).

    Args:
        streams: ``[T, n, D]``. fn: ``[n, n*D]``. base: ``[n]``. scale: ``[1]``.

    Returns:
        ``[T, D]`` in the stream dtype.
    """
    flat = _flat_normed(streams, norm_eps)
    with autocast_off(flat):
        mix = F.linear(flat, fn.to(flat.dtype))
    pre = torch.sigmoid(mix * scale.to(flat.dtype) + base.to(flat.dtype)) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hc_combine_ref(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """New streams ``X'_k = post_k * y + sum_j comb[j, k] X_j``.

    Args:
        streams: ``[T, n, D]`` block input streams. block_out: ``[T, D]``.
        post: ``[T, n]``; comb: ``[T, n, n]`` (fp32; cast to the stream dtype like HF).

    Returns:
        ``[T, n, D]`` in the stream dtype.
    """
    dtype = streams.dtype
    with autocast_off(streams):
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed

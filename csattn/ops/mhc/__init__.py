"""mHC (manifold-constrained hyper-connections): the weights of one site from its ``n`` residual streams, the
collapse into the block input, the combine back into the streams, and the final head.

``backend``: ``"reference"`` (plain PyTorch, :mod:`.naive`), ``"triton"`` (fused kernels, :mod:`.triton`; CUDA,
or the CPU interpreter under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton on CUDA tensors, the reference
elsewhere, as the attention layer resolves its backend).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..backend import BACKENDS, BackendChoice, resolve_backend
from ..rms_norm import rms_norm
from .config import MhcConfig
from .naive import hc_combine_ref, hc_head_ref, hc_pre_ref, sinkhorn_ref

__all__ = ["BACKENDS", "MhcConfig", "Site", "hc_site", "hc_pre", "hc_head", "hc_combine", "resolve_backend",
           "hc_pre_ref", "hc_head_ref", "hc_combine_ref", "sinkhorn_ref"]



class Site(NamedTuple):
    """One mHC site as a block uses it (:func:`hc_site`)."""

    post: Tensor  # [T, n]
    comb: Tensor  # [T, n, n]
    x: Tensor  # [T, D] the block input (normed with norm_weight)
    streams: Tensor  # [T, n, D] the streams for this site's combine (see hc_site)
    again: Callable[[Tensor], Tensor]  # again(streams) -> x, bit for bit, without autograd


def hc_pre(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, sinkhorn_iters: int, hc_eps: float,
           norm_eps: float, norm_weight: Tensor | None = None, rms_eps: float = 1e-6,
           backend: BackendChoice = "auto", config: MhcConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One mHC site: mixing weights from the RMS-normalized flattened streams, and the collapsed block input.

    ``mix = (X / rms(X)) @ fn^T``; ``pre = sigmoid(mix_pre * scale[0] + base_pre) + eps``;
    ``post = 2 sigmoid(mix_post * scale[1] + base_post)``; ``comb = sinkhorn(mix_comb * scale[2] + base_comb)``;
    ``collapsed = sum_j pre_j X_j``.

    Args:
        streams: ``[T, n, D]`` (bf16 / fp32 / fp64). fn: ``[(2+n)*n, n*D]``. base: ``[(2+n)*n]``.
        scale: ``[3]``. sinkhorn_iters: Sinkhorn rounds (>= 1). hc_eps: weight epsilon. norm_eps: RMS epsilon.
        norm_weight: optional ``[D]``: return the block input ``rms_norm(collapsed, norm_weight, rms_eps)`` instead
            of ``collapsed`` (the RMSNorm that follows every site). The fused kernels then recompute the collapse in
            the backward instead of keeping it: ``D`` stream-dtype elements a token less per site.
        config: the fused kernels' launch settings (:class:`MhcConfig`; None: its defaults); the reference
            ignores it.

    Returns:
        ``post [T, n]``, ``comb [T, n, n]`` (fp32; fp64 for fp64 streams) and ``collapsed [T, D]`` (stream dtype;
        normed with ``norm_weight``).
    """
    site = hc_site(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps,
                   norm_weight=norm_weight, rms_eps=rms_eps, backend=backend, config=config)
    return site.post, site.comb, site.x


def hc_site(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, sinkhorn_iters: int, hc_eps: float,
            norm_eps: float, norm_weight: Tensor | None = None, rms_eps: float = 1e-6,
            backend: BackendChoice = "auto", config: MhcConfig | None = None) -> Site:
    """:func:`hc_pre` with what a block does around it (same arguments):

    - ``Site.streams``: the streams to hand to this site's :func:`hc_combine`. On the fused path an alias of
      ``streams`` whose gradient (the combine's) the site's backward adds into its own stream gradient in the
      pass that writes it, instead of autograd summing the two ``[T, n, D]`` gradients in another kernel; on the
      reference path ``streams`` itself.
    - ``Site.again(streams)``: the block input again, bit for bit and without autograd, from these streams (given
      again: the site keeps them, or the caller can redo them) and the logits the site keeps (one more read of the
      streams): for a caller that drops the block input from its consumers' saves
      (:func:`csattn.ops.recompute.rebuilt_saves`).
    """
    if resolve_backend(backend, streams) == "triton":
        from .triton import hc_site_triton  # lazy: importing csattn must not need Triton

        return Site(*hc_site_triton(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight,
                                    rms_eps, config))

    def site(streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        post, comb, collapsed = hc_pre_ref(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
        return post, comb, collapsed if norm_weight is None else rms_norm(collapsed, norm_weight, rms_eps)

    def again(streams: Tensor) -> Tensor:
        with torch.no_grad():
            return site(streams)[2]

    return Site(*site(streams), streams, again)


def hc_head(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, hc_eps: float, norm_eps: float,
            norm_weight: Tensor | None = None, rms_eps: float = 1e-6, backend: BackendChoice = "auto",
            config: MhcConfig | None = None) -> Tensor:
    """Final collapse ``sum_j pre_j X_j`` with ``pre = sigmoid((X / rms(X)) @ fn^T * scale + base) + eps``.

    Args:
        streams: ``[T, n, D]``. fn: ``[n, n*D]``. base: ``[n]``. scale: ``[1]``.
        norm_weight: optional ``[D]``: return ``rms_norm(collapse, norm_weight, rms_eps)`` (the model's final
            norm), the collapse recomputed in the fused backward (see :func:`hc_pre`).
        config: as in :func:`hc_pre`.

    Returns:
        ``[T, D]`` in the stream dtype.
    """
    if resolve_backend(backend, streams) == "triton":
        from .triton import hc_head_triton

        return hc_head_triton(streams, fn, base, scale, hc_eps, norm_eps, norm_weight, rms_eps, config)
    out = hc_head_ref(streams, fn, base, scale, hc_eps, norm_eps)
    return out if norm_weight is None else rms_norm(out, norm_weight, rms_eps)


def hc_combine(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor, *,
               backend: BackendChoice = "auto", config: MhcConfig | None = None) -> Tensor:
    """New streams ``X'_k = post_k * y + sum_j comb[j, k] X_j`` (``post`` / ``comb`` cast to the stream dtype).

    Args:
        streams: ``[T, n, D]``. block_out: ``[T, D]``. post: ``[T, n]``. comb: ``[T, n, n]``.
        config: as in :func:`hc_pre`.

    Returns:
        ``[T, n, D]`` in the stream dtype.
    """
    if resolve_backend(backend, streams) == "triton":
        from .triton import hc_combine_triton

        return hc_combine_triton(streams, block_out, post, comb, config)
    return hc_combine_ref(streams, block_out, post, comb)

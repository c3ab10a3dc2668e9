"""Manifold-constrained hyper-connections (mHC): ``n`` residual streams per token, collapsed into one block
input by ``pre`` weights, written back by ``post`` weights, and mixed by a Sinkhorn-normalized (doubly
stochastic) ``comb`` matrix. Parameter names equal Hugging Face's ``DeepseekV4HyperConnection`` /
``DeepseekV4HyperHead``.

The math lives in :mod:`csattn.ops.mhc` (a PyTorch reference and fused Triton kernels, chosen by ``backend``).
The weights are computed in fp32 from the RMS-normalized, flattened streams (HF keeps these modules in
fp32; see ``FP32_MODULES`` in ``model.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...layers.modules import RMSNorm
from ...ops import mhc as mhc_ops
from ...ops.backend import BackendChoice

__all__ = ["HyperConnection", "HyperHead", "expand_streams", "hc_combine"]


def expand_streams(x: Tensor, n: int) -> Tensor:
    """``[T, D]`` -> ``[T, n, D]``: the embedding copied into every stream."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def hc_combine(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor,
               backend: BackendChoice = "auto") -> Tensor:
    """New streams ``X'_k = post_k * y + sum_j comb[j, k] X_j``.

    Args:
        streams: ``[T, n, D]`` block input streams. block_out: ``[T, D]``.
        post: ``[T, n]``; comb: ``[T, n, n]`` (fp32; cast to the stream dtype like HF).
        backend: ``"auto"`` / ``"reference"`` / ``"triton"`` (see :mod:`csattn.ops.mhc`).
    """
    return mhc_ops.hc_combine(streams, block_out, post, comb, backend=backend)


class HyperConnection(nn.Module):
    """One mHC site (before the attention or the MoE of a block).

    ``forward(streams [T, n, D], norm)`` returns a :class:`~csattn.ops.mhc.Site`: ``post [T, n]``, ``comb
    [T, n, n]`` (fp32), the collapsed block input ``[T, D]`` (stream dtype), normed by ``norm`` (the block's
    RMSNorm) when given (the fused kernels then recompute the collapse in the backward instead of keeping it),
    the streams for ``combine`` and ``again``. ``combine`` writes a block output back into the streams.
    """

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 backend: BackendChoice = "auto") -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.backend = backend
        width = (2 + hc_mult) * hc_mult  # pre (n) + post (n) + comb (n * n)
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: Tensor, norm: RMSNorm | None = None) -> mhc_ops.Site:
        """:func:`mhc_ops.hc_site`: ``post``, ``comb``, the block input, the streams to hand to :meth:`combine`
        and how to compute the block input again."""
        return mhc_ops.hc_site(streams, self.fn, self.base, self.scale, sinkhorn_iters=self.sinkhorn_iters,
                               hc_eps=self.hc_eps, norm_eps=self.norm_eps, **_norm_args(norm), backend=self.backend)

    def combine(self, streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """:func:`hc_combine` on this site's backend: streams ``[T, n, D]``, block output ``[T, D]``,
        ``post [T, n]``, ``comb [T, n, n]`` -> ``[T, n, D]``."""
        return hc_combine(streams, block_out, post, comb, backend=self.backend)


class HyperHead(nn.Module):
    """Final collapse of the streams (sigmoid weights, no Sinkhorn): ``[T, n, D]`` -> ``[T, D]``, normed by
    ``norm`` (the model's final RMSNorm) when given, as :class:`HyperConnection` does."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float,
                 backend: BackendChoice = "auto") -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.backend = backend
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))
        nn.init.normal_(self.hc_fn, std=0.02)

    def forward(self, streams: Tensor, norm: RMSNorm | None = None) -> Tensor:
        return mhc_ops.hc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, hc_eps=self.hc_eps,
                               norm_eps=self.norm_eps, **_norm_args(norm), backend=self.backend)


def _norm_args(norm: RMSNorm | None) -> dict:
    return {} if norm is None else {"norm_weight": norm.weight, "rms_eps": norm.eps}

"""Manifold-constrained hyper-connections (mHC): ``n`` residual streams per token, collapsed into one block
input by ``pre`` weights, written back by ``post`` weights, and mixed by a Sinkhorn-normalized (doubly
stochastic) ``comb`` matrix. Parameter names equal Hugging Face's ``DeepseekV4HyperConnection`` /
``DeepseekV4HyperHead``.

The weights are computed in fp32 from the RMS-normalized, flattened streams (HF keeps these modules in
fp32; see ``FP32_MODULES`` in ``model.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["HyperConnection", "HyperHead", "expand_streams", "hc_combine"]


def _flat_normed(streams: Tensor, eps: float) -> Tensor:
    """``[T, n, D]`` -> ``[T, n*D]`` fp32 (fp64 for fp64 input), divided by its RMS (no weight)."""
    compute = torch.promote_types(streams.dtype, torch.float32)
    flat = streams.flatten(-2).to(compute)
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def expand_streams(x: Tensor, n: int) -> Tensor:
    """``[T, D]`` -> ``[T, n, D]``: the embedding copied into every stream."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def hc_combine(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """New streams ``X'_k = post_k * y + sum_j comb[j, k] X_j``.

    Args:
        streams: ``[T, n, D]`` block input streams. block_out: ``[T, D]``.
        post: ``[T, n]``; comb: ``[T, n, n]`` (fp32; cast to the stream dtype like HF).
    """
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams)


class HyperConnection(nn.Module):
    """One mHC site (before the attention or the MoE of a block).

    ``forward(streams [T, n, D])`` returns ``post [T, n]``, ``comb [T, n, n]`` (fp32) and the collapsed block
    input ``[T, D]`` (stream dtype).
    """

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult  # pre (n) + post (n) + comb (n * n)
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.hc_mult
        flat = _flat_normed(streams, self.norm_eps)
        mix = F.linear(flat, self.fn.to(flat.dtype))
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        base = self.base.to(flat.dtype)
        scale = self.scale.to(flat.dtype)
        pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + base[n:2 * n])
        comb = comb_w.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns first, then (iters - 1) rounds of rows and columns.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """Final collapse of the streams (sigmoid weights, no Sinkhorn): ``[T, n, D]`` -> ``[T, D]``."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))
        nn.init.normal_(self.hc_fn, std=0.02)

    def forward(self, streams: Tensor) -> Tensor:
        flat = _flat_normed(streams, self.norm_eps)
        mix = F.linear(flat, self.hc_fn.to(flat.dtype))
        pre = torch.sigmoid(mix * self.hc_scale.to(flat.dtype) + self.hc_base.to(flat.dtype)) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)

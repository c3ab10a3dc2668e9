"""Sparse attention with a per-head sink over per-row key index lists."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import Backend, use_triton
from .config import SparseAttnConfig
from .naive import sparse_attn_chunk, sparse_attn_ref

__all__ = ["SparseAttnConfig", "sparse_attn", "sparse_attn_chunk", "sparse_attn_ref"]


def _apply_length(indices: Tensor, topk_length: Tensor) -> Tensor:
    """Turn a per-row valid length into ``-1`` entries, the reference's only way to skip keys."""
    cols = torch.arange(indices.shape[1], device=indices.device)
    return torch.where(cols[None, :] < topk_length[:, None].to(cols.dtype), indices, indices.new_full((), -1))


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    chunk_rows: int = 1024,
    topk_length: Tensor | None = None,
    backend: Backend = "reference",
    config: SparseAttnConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Dispatch point for sparse attention: ``(o [T, H, d], lse [T, H])``.

    ``backend="reference"`` runs the plain-PyTorch reference (row chunks of ``chunk_rows``);
    ``"triton"`` the fused kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``;
    ``chunk_rows`` is not needed there). ``topk_length [T]`` optionally limits row ``t`` to its first
    ``topk_length[t]`` index entries. ``config`` sets the fused kernels' launch settings
    (:class:`SparseAttnConfig`, None: the defaults; the reference ignores it). See :func:`sparse_attn_ref` for
    shapes.
    """
    if use_triton(backend):
        from .triton import sparse_attn_triton  # lazy: importing csattn must not need Triton

        return sparse_attn_triton(q, kv, indices, sink, scale, topk_length=topk_length, config=config)
    if topk_length is not None:
        indices = _apply_length(indices, topk_length)
    return sparse_attn_ref(q, kv, indices, sink, scale, chunk_rows=chunk_rows)

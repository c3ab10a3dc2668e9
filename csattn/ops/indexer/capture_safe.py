"""Capture-safe indexer top-k: row chunks of a static height, candidates read over a static window instead of
the data-dependent key slabs of ``row_chunks`` (which reads ``vis_start`` on the host).

Row t's candidates are the ``width`` ids ``vis_start[t] + j`` (``width`` = the static bound on the visible
range, ``max_seqlen // r``); ids at or past ``vis_end[t]`` are masked. Candidates stay in id order, so a
stable sort breaks ties to the lower id exactly as the reference does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import Backend
from .chunks import fixed_row_chunks, ids_ascending
from .naive import indexer_scores_ref

__all__ = ["indexer_topk_capture_safe", "static_window"]


def static_window(vis_start: Tensor, vis_end: Tensor, width: int, num_keys: int) -> tuple[Tensor, Tensor]:
    """Candidate ids ``[R, width]`` (clamped into the key table) and their validity."""
    ids = vis_start[:, None] + torch.arange(width, device=vis_start.device)[None, :]
    valid = ids < vis_end[:, None]
    return ids.clamp(max=max(num_keys - 1, 0)), valid


@torch.no_grad()
def indexer_topk_capture_safe(
    q: Tensor,
    w: Tensor,
    k: Tensor,
    vis_start: Tensor,
    vis_end: Tensor,
    topk: int,
    width: int,
    workspace_bytes: int = 1 << 30,
    backend: Backend = "reference",
    config=None,
) -> Tensor:
    """Causal top-k of indexer scores without host syncs; same result as ``indexer_topk``.

    Args:
        q: ``[T, HI, cI]``; w: ``[T, HI]``; k: ``[Nc, cI]`` (``Nc`` may be a static capacity).
        vis_start, vis_end: ``[T]`` int64 visible ranges, ``vis_end - vis_start <= width``.
        topk: width of the result. width: static bound on any row's visible range.
        workspace_bytes: bound on one chunk's workspace.
        backend: ``"reference"`` or ``"triton"`` (fused kernels over static chunks).
        config: the fused kernels' ``IndexerConfig`` (None: the defaults; the reference ignores it).

    Returns:
        ``[T, topk]`` int64 global ids, ascending, ties to the lower id, -1 where unused.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if backend == "triton":
        from .capture_safe_triton import indexer_topk_capture_safe_triton

        return indexer_topk_capture_safe_triton(q, w, k, vis_start, vis_end, topk, width, workspace_bytes,
                                                config=config)
    if backend != "reference":
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    num_rows = q.shape[0]
    out = torch.full((num_rows, topk), -1, dtype=torch.int64, device=q.device)
    if width < 1 or k.shape[0] == 0:
        return out
    elsize = torch.promote_types(q.dtype, torch.float32).itemsize
    per_row = width * (2 * q.shape[1] * elsize + k.shape[1] * k.element_size())
    for lo, hi in fixed_row_chunks(num_rows, per_row, workspace_bytes):
        ids, valid = static_window(vis_start[lo:hi], vis_end[lo:hi], width, k.shape[0])
        scores = indexer_scores_ref(q[lo:hi], w[lo:hi], k[ids]).masked_fill(~valid, float("-inf"))
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
        picked = torch.where(scores.gather(1, order) > float("-inf"), ids.gather(1, order), -1)
        out[lo:hi, : picked.shape[1]] = ids_ascending(picked)
    return out

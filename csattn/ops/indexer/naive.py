"""Reference lightning indexer: ``I[t, i] = sum_h w[t, h] * relu(q[t, h] . k[i])`` and a causal top-k that
never holds more than a fixed workspace of scores at once."""

from __future__ import annotations

import torch
from torch import Tensor

from .chunks import ids_ascending, row_chunks

__all__ = ["indexer_scores_ref", "indexer_topk_ref"]


def indexer_scores_ref(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """Scores of rows against a slab of keys.

    Args:
        q: ``[R, HI, cI]`` indexer queries.
        w: ``[R, HI]`` head weights (already scaled by ``cI^-0.5 * HI^-0.5``).
        k: ``[K, cI]`` indexer keys, or ``[R, K, cI]`` per-row gathered keys.

    Returns:
        ``[R, K]`` in fp32 (fp64 for fp64 inputs).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, w, k = q.to(dtype), w.to(dtype), k.to(dtype)
    if k.dim() == 2:
        logits = torch.einsum("rhc,kc->rhk", q, k)
    else:
        logits = torch.einsum("rhc,rkc->rhk", q, k)
    return torch.einsum("rhk,rh->rk", logits.relu(), w)


@torch.no_grad()
def indexer_topk_ref(
    q: Tensor,
    w: Tensor,
    k: Tensor,
    vis_start: Tensor,
    vis_end: Tensor,
    topk: int,
    workspace_bytes: int = 1 << 30,
) -> Tensor:
    """Causal top-k of indexer scores per row.

    Args:
        q: ``[T, HI, cI]``; w: ``[T, HI]``; k: ``[Nc, cI]`` (all documents' keys, concatenated).
        vis_start, vis_end: ``[T]`` int64, row t may pick ids in ``[vis_start[t], vis_end[t])``.
        topk: width of the result (>= 1).
        workspace_bytes: bound on the scores workspace (rows x keys x heads) of one chunk.

    Returns:
        ``[T, topk]`` int64 global key ids of each row's ``topk`` best keys (ties go to the lower id) in
        ascending id order; unused slots are -1.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    num_rows = q.shape[0]
    out = torch.full((num_rows, topk), -1, dtype=torch.int64, device=q.device)
    elsize = torch.promote_types(q.dtype, torch.float32).itemsize
    per_key_row = 2 * q.shape[1] * elsize  # logits and their relu
    for lo, hi, key_lo, key_hi in row_chunks(vis_start, vis_end, per_key_row, workspace_bytes):
        if key_hi <= key_lo:
            continue
        scores = indexer_scores_ref(q[lo:hi], w[lo:hi], k[key_lo:key_hi])
        ids = torch.arange(key_lo, key_hi, device=q.device)
        visible = (ids[None, :] >= vis_start[lo:hi, None]) & (ids[None, :] < vis_end[lo:hi, None])
        scores = scores.masked_fill(~visible, float("-inf"))
        # A stable descending sort keeps equal scores in id order, so ties resolve to the lower id in
        # every layout (chunked, fused, context-parallel).
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
        picked_scores = scores.gather(1, order)
        picked = torch.where(picked_scores > float("-inf"), order + key_lo, -1)
        out[lo:hi, : picked.shape[1]] = ids_ascending(picked)
    return out

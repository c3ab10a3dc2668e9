"""Reference lightning indexer: ``I[t, i] = sum_h w[t, h] * relu(q[t, h] . k[i])`` and a causal top-k that
never holds more than a fixed workspace of scores at once."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["indexer_scores_ref", "indexer_topk_ref", "row_chunks", "fixed_row_chunks", "ids_ascending"]


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


def ids_ascending(ids: Tensor) -> Tensor:
    """``[R, k]`` id lists (-1 = none) in ascending id order, the -1 slots last: the order every top-k path
    returns, so a selected set has one representation whatever the path."""
    big = torch.iinfo(ids.dtype).max
    ordered = torch.sort(torch.where(ids < 0, big, ids), dim=1).values
    return torch.where(ordered == big, -1, ordered)


def fixed_row_chunks(num_rows: int, bytes_per_row: int, budget: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` row chunks of one fixed height that keeps ``height * bytes_per_row`` within ``budget``."""
    step = max(1, budget // max(bytes_per_row, 1))
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def row_chunks(
    vis_start: Tensor, vis_end: Tensor, bytes_per_key_row: int, budget: int
) -> list[tuple[int, int, int, int]]:
    """Split rows into chunks whose key slab keeps ``rows * keys * bytes_per_key_row`` within ``budget``.

    Every row's visible keys are a contiguous id range ``[vis_start, vis_end)`` and ranges are ordered
    with the rows, so a chunk of consecutive rows needs the slab ``[min start, max end)``.

    Returns:
        ``(row_lo, row_hi, key_lo, key_hi)`` tuples covering all rows (host ints).
    """
    starts = vis_start.tolist()
    ends = vis_end.tolist()
    num_rows = len(starts)
    out = []
    lo = 0
    while lo < num_rows:
        hi = lo + 1
        key_lo, key_hi = starts[lo], ends[lo]
        while hi < num_rows:
            new_hi = max(key_hi, ends[hi])
            new_lo = min(key_lo, starts[hi])
            if (hi + 1 - lo) * max(new_hi - new_lo, 1) * bytes_per_key_row > budget:
                break
            key_lo, key_hi = new_lo, new_hi
            hi += 1
        out.append((lo, hi, key_lo, max(key_hi, key_lo)))
        lo = hi
    return out


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

"""Per-row key index lists for sparse attention over ``[raw kv rows | compressed entries]``.

Index ``j < T`` addresses raw row ``j``; ``j >= T`` addresses compressed entry ``j - T``; ``-1`` is no key.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["window_indices", "range_indices", "combine_indices", "gather_rows_masked", "take_rows"]


def window_indices(pos: Tensor, real: Tensor, window: int) -> Tensor:
    """Sliding-window keys: rows ``t - window + 1 .. t`` of the same document (``window`` keys incl. self).

    Args:
        pos: ``[T]`` int64 position of each row inside its document.
        real: ``[T]`` bool; padding rows get no keys.
        window: W >= 1.

    Returns:
        ``[T, W]`` int64 row ids, oldest first, -1 before the document start.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    offs = torch.arange(-window + 1, 1, device=pos.device)
    rows = torch.arange(pos.shape[0], device=pos.device)[:, None] + offs[None, :]
    valid = (pos[:, None] + offs[None, :] >= 0) & real[:, None]
    return torch.where(valid, rows, -1)


def range_indices(start: Tensor, end: Tensor, width: int) -> Tensor:
    """All ids of ``[start, end)`` per row, padded with -1 to ``width`` (HCA: every visible entry).

    Returns ``[T, width]`` int64.
    """
    ids = start[:, None] + torch.arange(width, device=start.device)[None, :]
    return torch.where(ids < end[:, None], ids, -1)


def combine_indices(window_ids: Tensor, compressed_ids: Tensor | None, num_rows: int) -> Tensor:
    """Concatenate window ids and compressed ids shifted by ``num_rows`` (keeping -1)."""
    if compressed_ids is None or compressed_ids.shape[1] == 0:
        return window_ids
    shifted = torch.where(compressed_ids >= 0, compressed_ids + num_rows, -1)
    return torch.cat([window_ids, shifted], dim=1)


def take_rows(table: Tensor, ids: Tensor) -> Tensor:
    """``table[ids]`` (``[*ids.shape, *table.shape[1:]]``, ``ids`` in range) through ``index_select``.

    Why: the backward of ``table[ids]`` is ``index_put_(..., accumulate=True)``, whose CPU kernel sums repeated rows
    in an order that changes from run to run with more than one thread (two runs of one training step differed in
    the last bits); ``index_select``'s is ``index_add_``, the same sums in one order.
    """
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, *table.shape[1:])


def gather_rows_masked(table: Tensor, ids: Tensor) -> Tensor:
    """``table[ids]`` with zero rows where ``ids < 0`` (``[*ids.shape, *table.shape[1:]]``).

    Why not ``table[ids.clamp(min=0)]`` and a zero weight: the clamped slots read row 0, which belongs to some
    other document, and its backward adds ``0 * g`` into row 0's gradient; a NaN or Inf in ``g`` (from a
    poisoned row of another document) then makes row 0's gradient NaN. ``torch.where`` selects instead of
    multiplying, in the forward (a NaN in row 0 never shows) and in the backward (no gradient reaches row 0
    from an empty slot), so each row's results depend only on the rows it names.
    """
    valid = ids >= 0
    rows = take_rows(table, ids.clamp(min=0))
    mask = valid.reshape(*valid.shape, *([1] * (rows.dim() - valid.dim())))
    return torch.where(mask, rows, rows.new_zeros(()))

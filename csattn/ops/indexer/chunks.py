"""Row planning shared by the indexer's reference, capture-safe and fused paths (and the indexer loss): row chunks
within a workspace, and the one order of a selected id list."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fixed_row_chunks", "ids_ascending", "row_chunks"]


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

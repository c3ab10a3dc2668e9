"""The exchange steps of the context-parallel plans: what the layer's one flow calls between its phases.

Halo: every rank publishes the last ``Hh`` rows of each of its segments (one all-gather, the same size on
every rank); each rank then takes, for each of its segments, the tail of the segment that ends where it
starts. The backward is the all-gather's reduce-scatter: each halo row's gradient goes back to the rank that
owns the row. Projections of the halo rows are recomputed locally from the received input rows (cheaper to
send ``D``-wide inputs once than every projected tensor).

Entries: each rank pools the compressed groups it owns (those whose last token it holds). The eager plan
all-gathers them (padded to the most any rank owns) and puts them in global id order; the capture-safe plan
pools over the global static capacity, every other slot exactly zero, and sums them with one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

from ..layers.modules import RowPieces
from ..layers.plan import Exchange
from .gather import PendingGather, start_gather_rows

__all__ = ["GatherIndex", "GatherExchange", "AllReduceExchange"]


def _split(entries: Tensor, widths: list[int]) -> list[Tensor]:
    # contiguous copies (T / r rows): the fused kernels take dense row-major operands
    cols = [0, *accumulate(widths)]
    return [entries[:, a:b].contiguous() for a, b in zip(cols, cols[1:])]


def _joined(parts: list[Tensor]) -> Tensor:
    return torch.cat([parts[0], *(p.to(parts[0].dtype) for p in parts[1:])], dim=1)


@dataclass
class GatherIndex:
    """Host index of the eager exchange (from ``cp/plan.py``), cached with the plan."""

    halo: int  # Hh
    tail_index: Tensor | None  # [S * Hh] local rows this rank sends (the last Hh rows of each segment)
    pieces: list[tuple[str, int, int]]  # ext rows in order: ("halo", start in gathered tails, n) / ("local", start, n)
    num_entries: int = 0  # entries of the whole stream
    num_owned: int = 0  # entries this rank pools
    max_owned: int = 0  # most entries any rank owns (the gather slot count)
    gathered_order: Tensor | None = None  # [Nc] position of each global entry in the gathered buffer


class GatherExchange(Exchange):
    """The eager CP exchange: halo all-gather, then the all-gather of the owned entries, both asynchronous."""

    def __init__(self, index: GatherIndex, group: Any) -> None:
        self.index, self.group = index, group

    def start_halo(self, x: Tensor) -> PendingGather | None:
        """Launch the tail all-gather (None when this layer needs no halo, on every rank alike)."""
        if self.index.halo == 0:
            return None
        return start_gather_rows(x[self.index.tail_index], self.group)

    def finish_halo(self, x: Tensor, pending: PendingGather | None) -> Tensor | RowPieces:
        """The ext rows ``[n_ext, D]`` (per segment: halo, then own rows) as :class:`RowPieces`: views of the
        received tails and of ``x``, never concatenated, so the input projections save no copy of this rank's
        rows."""
        if pending is None:
            return x
        tails = pending.wait()  # [P * S * Hh, D]
        # Halo rows are copied out of the gathered buffer: the projections save their inputs, and a saved view
        # would keep every rank's tails ([P * S * Hh, D]) alive until the backward, not just this rank's halo.
        pieces = self.index.pieces
        parts = [tails[s:s + n].clone() if kind == "halo" else x[s:s + n] for kind, s, n in pieces]
        if all(kind == "local" for kind, _, _ in pieces):
            # This rank needs no halo but must still run the exchange's backward collective, in the same
            # place of the backward order as every other rank: keep the received tails in the graph.
            parts.insert(0, tails[:0].clone())
        return RowPieces(tuple(parts))

    def start_entries(self, parts: list[Tensor]) -> Any:
        index = self.index
        if index.num_entries == 0:  # no entry anywhere in the stream: the same decision on every rank
            return parts
        owned = _joined(parts)
        if index.max_owned > index.num_owned:
            owned = torch.cat([owned, owned.new_zeros(index.max_owned - index.num_owned, owned.shape[1])])
        return start_gather_rows(owned, self.group), [p.shape[1] for p in parts]

    def finish_entries(self, pending: Any) -> list[Tensor]:
        if isinstance(pending, list):
            return pending
        gather, widths = pending
        return _split(gather.wait()[self.index.gathered_order], widths)  # [Nc, d (+ cI)] in global id order


class AllReduceExchange(Exchange):
    """The capture-safe CP exchange (contiguous rows, static shapes): one all-gather of every rank's last ``Hh``
    rows (rank p's halo is rank p - 1's tail), and one all-reduce (sum) of the entries pooled over the global
    capacity, where each slot has one nonzero term, so the sum is exact."""

    def __init__(self, rank: int, size: int, halo: int, group: Any) -> None:
        self.rank, self.size, self.halo, self.group = rank, size, halo, group

    def start_halo(self, x: Tensor) -> PendingGather | None:
        if self.size == 1 or self.halo == 0:
            return None
        return start_gather_rows(x[x.shape[0] - self.halo:], self.group)

    def finish_halo(self, x: Tensor, pending: PendingGather | None) -> Tensor | RowPieces:
        if pending is None:
            return x
        received, rank, halo = pending.wait(), self.rank, self.halo  # [P * Hh, D]
        # rank 0 keeps an empty slice so it joins the exchange's backward collective like every other rank;
        # copied out so that the saved halo does not keep every rank's tails alive
        mine = received[(rank - 1) * halo:rank * halo] if rank else received[:0]
        return RowPieces((mine.clone(), x))

    def finish_entries(self, pending: list[Tensor]) -> list[Tensor]:
        entries = _joined(pending)
        if self.size > 1:
            entries = all_reduce_with_grad(entries, group=self.group)  # one nonzero term per slot
        return _split(entries, [p.shape[1] for p in pending])

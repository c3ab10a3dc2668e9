"""Left-halo exchange of the attention input.

Every rank publishes the last ``Hh`` rows of each of its segments (one all-gather of ``[S * Hh, D]``, the
same size on every rank); each rank then takes, for each of its segments, the tail of the segment that
ends where it starts. The backward is the all-gather's reduce-scatter: each halo row's gradient goes back
to the rank that owns the row. Projections of the halo rows are recomputed locally from the received
input rows (cheaper to send ``D``-wide inputs once than every projected tensor).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..layers.modules import RowPieces
from .gather import PendingGather, start_gather_rows
from .plan import LayerPlan

__all__ = ["start_halo_exchange", "finish_halo_exchange"]


def start_halo_exchange(x_local: Tensor, plan: LayerPlan, group: Any) -> PendingGather | None:
    """Launch the tail all-gather (None when this layer needs no halo, on every rank alike)."""
    if plan.halo == 0:
        return None
    return start_gather_rows(x_local[plan.tail_index], group)


def finish_halo_exchange(x_local: Tensor, plan: LayerPlan, pending: PendingGather | None) -> Tensor | RowPieces:
    """Wait for the tails and return the ext rows ``[n_ext, D]`` (per segment: halo, then own rows) as
    :class:`RowPieces`: views of the received tails and of ``x_local``, never concatenated, so the input
    projections save no copy of this rank's rows."""
    if pending is None:
        return x_local
    tails = pending.wait()  # [P * S * Hh, D]
    # Halo rows are copied out of the gathered buffer: the projections save their inputs, and a saved view
    # would keep every rank's tails ([P * S * Hh, D]) alive until the backward, not just this rank's halo.
    parts = [tails[s:s + n].clone() if kind == "halo" else x_local[s:s + n] for kind, s, n in plan.pieces]
    if all(kind == "local" for kind, _, _ in plan.pieces):
        # This rank needs no halo but must still run the exchange's backward collective, in the same
        # place of the backward order as every other rank: keep the received tails in the graph.
        parts.insert(0, tails[:0].clone())
    return RowPieces(tuple(parts))

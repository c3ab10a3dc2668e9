"""The per-rank plan of one layer call: what differs between the single-process, context-parallel and
capture-safe runs of :class:`csattn.HybridAttention`, so that the layer itself runs one flow.

A plan says which rows are local (their positions and real flags), which *ext* rows the window and the
compressors read (the local rows, or each segment's left halo followed by its rows), the window ids into the
ext rows, which compressed entries this rank pools and every local row's visible range of global entry ids,
the exchange steps between the phases (the identity on one process) and the op set (eager ops, or their
``torch.library`` custom ops on the capture-safe path). A :class:`Planner` builds it: :data:`LOCAL` here, or a
``csattn.ContextParallel`` (``csattn/cp``), both with ``plan(x, packed, config)``; ``packed`` is any
:data:`Packed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor

from ..config import AttentionConfig
from ..ops.indices import window_indices
from ..packing import CompressMeta, PackedSeqs
from ..packing_capture_safe import CaptureSafeCompressMeta, CaptureSafePackedSeqs
from .modules import RowPieces
from .op_sets import CAPTURE_SAFE, EAGER, OpSet

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CompressedRange", "IndexerLossInputs", "Entries", "Exchange", "IDENTITY", "LayerPlan", "LocalPlanner",
           "LOCAL", "ContextParallelGroup", "Packed", "PackedSeqParamsLike", "Planner", "capture_safe_pack"]


class PackedSeqParamsLike(Protocol):
    """Megatron's ``PackedSeqParams`` as the layer reads it (:meth:`PackedSeqs.coerce`)."""

    cu_seqlens_q: Tensor | None
    cu_seqlens_q_padded: Tensor | None


#: The packed metadata a layer call takes (``packed=``): a :class:`PackedSeqs`, a :class:`CaptureSafePackedSeqs`
#: (which asks for the capture-safe plan), or Megatron's ``PackedSeqParams``; None on the layer: one document.
Packed: TypeAlias = "PackedSeqs | CaptureSafePackedSeqs | PackedSeqParamsLike"


class CompressedRange(NamedTuple):
    """Every compressed id in ``[start[t], end[t])`` for row t; ``width`` bounds ``end - start``."""

    start: Tensor
    end: Tensor
    width: int


class IndexerLossInputs(NamedTuple):
    """What the indexer KL loss needs besides the attention: the indexer's queries, weights and keys, which
    rows are real (``num_real`` over the whole stream, global under context parallelism), the visible
    compressed-id ranges (for the dense loss) and their host bound ``width``."""

    q_idx: Tensor
    w: Tensor
    k_idx: Tensor
    real: Tensor
    num_real: int | Tensor  # a host int, or a device scalar on the capture-safe path
    vis_start: Tensor
    vis_end: Tensor
    width: int

    def row_weight(self, dtype: torch.dtype) -> Tensor:
        """``1 / num_real`` for real rows, 0 for padding (divided on the device for a device count)."""
        if isinstance(self.num_real, Tensor):
            return self.real.to(dtype) / self.num_real.clamp(min=1)
        return self.real.to(dtype) / max(self.num_real, 1)


@dataclass
class Entries:
    """The compressed entries of one layer call, seen from this rank.

    ``meta`` lists the entries this rank pools (``entry_row`` indexes its ext rows, less ``shift``); the
    exchange then puts every rank's entries in global id order. On the capture-safe path ``meta`` spans the
    static capacity: the slots not in ``keep`` (tail slots, and under context parallelism the entries another
    rank owns) pool a zero scratch block placed after the ``ext_rows`` rows, so they come out exactly zero.
    """

    meta: CompressMeta | CaptureSafeCompressMeta
    vis_start: Tensor  # [L] int64 first global id row t sees
    vis_end: Tensor  # [L] int64 one past its last
    max_visible: int  # host bound on vis_end - vis_start over the whole stream
    keep: Tensor | None = None  # capture-safe: [capacity] bool, the slots this rank pools
    ext_rows: int = 0  # capture-safe: rows of the ext input
    shift: int = 0  # capture-safe: global row of ext row 0


class Exchange:
    """What crosses ranks between the phases: the identity on one process. The context-parallel exchanges
    (``csattn/cp``) launch a collective in ``start_*`` and wait in ``finish_*``, so the phase the layer runs
    between the two overlaps it."""

    def start_halo(self, x: Tensor) -> Any:
        """Launch the left-halo exchange of the input rows ``x [L, D]``."""
        return None

    def finish_halo(self, x: Tensor, pending: Any) -> Tensor | RowPieces:
        """The ext rows: per segment its halo, then its own rows (here: ``x`` itself)."""
        return x

    def start_entries(self, parts: list[Tensor]) -> Any:
        """Launch the gather of this rank's pooled entries (``[compressed KV, indexer keys]``, one per part)."""
        return parts

    def finish_entries(self, pending: Any) -> list[Tensor]:
        """Every entry of the stream in global id order, one tensor per part (contiguous)."""
        return pending


IDENTITY = Exchange()


@dataclass
class LayerPlan:
    """One rank's plan of one layer call (see the module docstring). ``L`` local rows, ``n_ext`` ext rows."""

    pos: Tensor  # [L] int64 position of each local row in its document
    real: Tensor  # [L] bool, a real (non-padding) row
    num_real: int | Tensor  # real rows of the whole stream (host int, or device scalar when capture-safe)
    window_ids: Tensor  # [L, W] ext row ids, -1 = none
    exchange: Exchange  # IDENTITY on one process
    ops: OpSet  # EAGER or CAPTURE_SAFE
    pos_ext: Tensor | None = None  # [n_ext] positions of the ext rows; None = the ext rows are the local rows
    entries: Entries | None = None  # None on sliding-window layers
    # whether the local rows may hold padding (a host fact of the pack; True where unknown, the capture-safe plans):
    # the layer then zeroes those rows before any projection (see HybridAttention.forward_plan)
    padding: bool = True


@runtime_checkable
class Planner(Protocol):
    """What builds one rank's :class:`LayerPlan` of a layer call: :data:`LOCAL` (one process) or a
    ``csattn.ContextParallel``; the layer's ``cp=`` takes any object with this method."""

    def plan(self, x: Tensor, packed: Packed, config: AttentionConfig) -> LayerPlan:
        """This rank's plan for its rows ``x [L, D]`` of the stream ``packed`` describes."""
        ...


class ContextParallelGroup(Planner, Protocol):
    """The type of every ``cp=`` above the layer (the model, the capture-safe step, the CP plans, the trainer):
    what they use of a ``csattn.ContextParallel`` (``csattn/cp``, the one implementation), beyond its plans. It
    lives here, below ``cp/``, so those floors can name it without importing ``cp/``.

    ``packed`` always describes the global stream (every rank passes the same one).
    """

    group: ProcessGroup | None  # the CP process group (None: the default group)
    partition: str  # how the stream's rows are dealt to the ranks: "contiguous" or "balanced"

    @property
    def rank(self) -> int:
        """This process's rank in ``group``."""
        ...

    @property
    def size(self) -> int:
        """The ranks of ``group`` (P)."""
        ...

    def local_rows(self, packed: Packed, device: torch.device | str | None = None) -> Tensor:
        """``[T / P]`` int64 global row index of each of this rank's rows, in local order."""
        ...

    def shard(self, tensor: Tensor, packed: Packed) -> Tensor:
        """This rank's rows ``[T / P, ...]`` of a global ``[T, ...]`` tensor (differentiable)."""
        ...


def capture_safe_pack(packed: Packed, num_rows: int) -> CaptureSafePackedSeqs:
    """``packed`` as :class:`CaptureSafePackedSeqs` of a ``num_rows``-row stream (a static pack is kept as is)."""
    if isinstance(packed, CaptureSafePackedSeqs):
        return packed
    return CaptureSafePackedSeqs.from_packed(packed, num_rows)


class LocalPlanner:
    """Plans of one process: the whole stream is local, the exchange is the identity."""

    def plan(self, x: Tensor, packed: Packed, config: AttentionConfig) -> LayerPlan:
        """Args:
            x: ``[T, D]`` the packed stream.
            packed: its metadata (``PackedSeqs``, or a :class:`CaptureSafePackedSeqs` for the capture-safe plan).
            config: the layer's geometry; ``config.capture_safe`` also asks for the capture-safe plan.
        """
        if config.capture_safe or getattr(packed, "capture_safe", False):
            return self._capture_safe(x, capture_safe_pack(packed, x.shape[0]), config)
        packed = PackedSeqs.coerce(packed)
        packed.validate(x.shape[0], x.device)
        rows = packed.rows(x.device)
        entries = None
        if config.has_compressor:
            meta = packed.compress(config.compress_ratio, x.device)
            entries = Entries(meta, meta.vis_start, meta.vis_end, meta.max_visible)
        window_ids = window_indices(rows.pos, rows.real, config.sliding_window)
        return LayerPlan(rows.pos, rows.real, rows.num_real, window_ids, IDENTITY, EAGER, entries=entries,
                         padding=rows.num_real < x.shape[0])

    @staticmethod
    def _capture_safe(x: Tensor, static: CaptureSafePackedSeqs, config: AttentionConfig) -> LayerPlan:
        """No host sync and no data-dependent shape: entries over the static capacity, visible ranges bounded by
        ``max_seqlen // r``, the real-row count on the device, the custom op set."""
        if static.num_rows != x.shape[0]:
            raise ValueError(f"packed.num_rows = {static.num_rows} but hidden_states has {x.shape[0]} rows")
        if static.cu_seqlens_padded.device != x.device:
            raise ValueError(f"cu_seqlens_padded is on {static.cu_seqlens_padded.device} but the hidden states "
                             f"are on {x.device}")
        rows = static.rows(x.device)
        entries = None
        if config.has_compressor:
            meta = static.compress(config.compress_ratio, x.device)
            entries = Entries(meta, meta.vis_start, meta.vis_end, meta.max_visible, keep=meta.entry_valid,
                              ext_rows=x.shape[0])
        window_ids = window_indices(rows.pos, rows.real, config.sliding_window)
        return LayerPlan(rows.pos, rows.real, rows.num_real, window_ids, IDENTITY, CAPTURE_SAFE, entries=entries)


LOCAL = LocalPlanner()

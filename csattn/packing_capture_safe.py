"""Capture-safe packed metadata: every per-row and per-entry fact computed on the device from ``cu_seqlens``.

:class:`csattn.PackedSeqs` reads its prefix sums on the host (the number of compressed entries, the widest
visible range, the number of real rows), which a CUDA graph cannot do. Here every shape comes from host
ints that stay fixed between replays (``T``, the number of documents, ``max_seqlen``) and every
data-dependent count stays on the device, so one captured graph replays on a new pack whose document
boundaries differ (same ``T``, same number of documents, same ``max_seqlen``).

Compressed entries are laid out over a static capacity ``min(T // r, num_docs * (max_seqlen // r))``: the
real entries first (the same ids as ``PackedSeqs.compress``), then tail slots. A tail slot pools rows
``[0, r)`` as a harmless first entry; no row's visible range ``[vis_start, vis_end)`` ever reaches it, so
it never changes a result and receives a zero gradient. (On the fused backend, whose backward stores rather
than accumulates row gradients, the layer points tail slots at a zero scratch block after the stream instead.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .nosync import host_reads_forbidden
from .packing import PackedSeqs, entry_layout, row_layout

__all__ = ["CaptureSafePackedSeqs", "CaptureSafeRowMeta", "CaptureSafeCompressMeta", "compressed_capacity"]


def compressed_capacity(num_rows: int, num_docs: int, max_seqlen: int, ratio: int) -> int:
    """Static bound on the number of compressed entries: ``min(T // r, num_docs * (max_seqlen // r))``."""
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    return min(num_rows // ratio, num_docs * (max_seqlen // ratio))


@dataclass
class CaptureSafeRowMeta:
    """Per-row facts (``[T]`` unless noted), all on the device; same values as :class:`csattn.packing.RowMeta`."""

    doc: Tensor  # int64 document id of each row
    pos: Tensor  # int64 physical position inside the document
    real: Tensor  # bool, real (non-padding) row
    doc_start: Tensor  # [N] int64 first physical row of each document
    real_len: Tensor  # [N] int64 real length of each document
    num_real: Tensor  # [] int64 number of real rows (device scalar, never read on the host)


@dataclass
class CaptureSafeCompressMeta:
    """Compressed entries of ratio ``r`` over a static ``capacity``; the real count stays on the device.

    Entry ids ``< num_entries`` are exactly those of ``PackedSeqs.compress(r)``; ids in
    ``[num_entries, capacity)`` are tail slots (``entry_row = 0``, ``entry_first = True``) that no row sees.
    """

    ratio: int
    capacity: int  # host int: static number of entry slots
    max_visible: int  # host int: static bound on vis_end - vis_start (min(max_seqlen // r, capacity))
    cu_comp: Tensor  # [N+1] int64 prefix sum of real entries per document
    entry_row: Tensor  # [capacity] int64 first physical row of each entry's block
    entry_first: Tensor  # [capacity] bool, first entry of its document (tail slots: True)
    entry_pos: Tensor  # [capacity] int64 position of the entry's first token inside its document
    entry_valid: Tensor  # [capacity] bool, a real entry (False on tail slots)
    vis_start: Tensor  # [T] int64
    vis_end: Tensor  # [T] int64
    num_entries: Tensor  # [] int64 real number of entries (device scalar)


@dataclass
class CaptureSafePackedSeqs:
    """Packed-sequence metadata for capture-safe execution (CUDA graphs, ``torch.compile``).

    Args:
        cu_seqlens: ``[N+1]`` int32/int64 real-length prefix sum (on the device of the hidden states).
        cu_seqlens_padded: ``[N+1]`` physical layout; defaults to ``cu_seqlens``.
        num_rows: host int ``T``, the length of the packed stream.
        max_seqlen: host int bound on the longest physical document (a bound is enough: it only sizes
            buffers, so the same value can serve every pack a graph replays on).

    The constructor checks the prefix sums on the host (:meth:`check`), except while a CUDA graph is being
    captured, ``torch.compile`` traces or :class:`~csattn.nosync.NoHostSync` is active; nothing else here reads
    a tensor on the host.

    Example:
        >>> packed = CaptureSafePackedSeqs(cu, cu_pad, num_rows=4096, max_seqlen=2048)
        >>> out = attn(x, packed=packed)   # with AttentionConfig(capture_safe=True)
    """

    capture_safe = True  # class attribute: HybridAttention routes a pack of this type to the capture-safe path

    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor | None = None
    num_rows: int = 0
    max_seqlen: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._padded_given = self.cu_seqlens_padded is not None
        if self.cu_seqlens_padded is None:
            self.cu_seqlens_padded = self.cu_seqlens
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            cu = getattr(self, name)
            if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(f"{name} must be a 1-D tensor [num_docs + 1] with at least 2 entries")
            if cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be int32 or int64, got {cu.dtype}")
        if self.cu_seqlens.numel() != self.cu_seqlens_padded.numel():
            raise ValueError(f"cu_seqlens has {self.cu_seqlens.numel() - 1} documents but cu_seqlens_padded has "
                             f"{self.cu_seqlens_padded.numel() - 1}")
        if self.cu_seqlens.device != self.cu_seqlens_padded.device:
            raise ValueError("cu_seqlens and cu_seqlens_padded must be on the same device")
        if not isinstance(self.num_rows, int) or self.num_rows < 0:
            raise ValueError(f"num_rows must be a host int >= 0, got {self.num_rows!r}")
        if not isinstance(self.max_seqlen, int) or self.max_seqlen < 0:
            raise ValueError(f"max_seqlen must be a host int >= 0, got {self.max_seqlen!r}")
        # Bad prefix sums would give silently wrong output or an IndexError deep in the layer, so they are
        # checked here, once, where reading them is allowed. Not while capturing / compiling / under
        # NoHostSync (a step that builds its metadata inside the graph): there the caller checks beforehand.
        if not host_reads_forbidden(self.cu_seqlens):
            self.check()

    @classmethod
    def from_packed(cls, packed: Any, num_rows: int) -> CaptureSafePackedSeqs:
        """From a :class:`PackedSeqs` (or Megatron ``PackedSeqParams``) whose ``max_seqlen`` is set on the host."""
        if isinstance(packed, CaptureSafePackedSeqs):
            return packed
        packed = PackedSeqs.coerce(packed)
        if packed.max_seqlen is None:
            raise ValueError("max_seqlen must be given on the host for capture-safe execution "
                             "(PackedSeqs(max_seqlen=...) / PackedSeqParams.max_seqlen_q)")
        return cls(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=num_rows, max_seqlen=int(packed.max_seqlen))

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens_padded.numel() - 1

    def capacity(self, ratio: int) -> int:
        """Static number of compressed entry slots for ``ratio``."""
        return compressed_capacity(self.num_rows, self.num_docs, self.max_seqlen, ratio)

    def check(self, device: torch.device | None = None) -> None:
        """Validate the prefix sums against ``num_rows`` and ``max_seqlen`` (host sync; not for capture). Runs at
        construction outside capture; call it again after editing the prefix sums in place."""
        names = ("cu_seqlens", "cu_seqlens_padded" if self._padded_given else "cu_seqlens")
        PackedSeqs(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen, _names=names).validate(
            self.num_rows, device or self.cu_seqlens_padded.device)

    # ------------------------------------------------------------------ derived metadata (no host sync)
    def rows(self, device: torch.device | None = None) -> CaptureSafeRowMeta:
        """Per-row document id, position and real flag (cached on this object)."""
        device = device or self.cu_seqlens_padded.device
        key = ("rows", str(device))
        if key not in self._cache:
            doc, pos, real, doc_start, real_len = row_layout(
                self.cu_seqlens_padded.to(device), self.cu_seqlens, self.num_rows)
            self._cache[key] = CaptureSafeRowMeta(doc, pos, real, doc_start, real_len, real_len.sum())
        return self._cache[key]

    def compress(self, ratio: int, device: torch.device | None = None) -> CaptureSafeCompressMeta:
        """Compressed-entry layout for ``ratio`` over the static capacity (cached on this object)."""
        if ratio < 1:
            raise ValueError(f"compress ratio must be >= 1, got {ratio}")
        device = device or self.cu_seqlens_padded.device
        key = ("compress", ratio, str(device))
        if key not in self._cache:
            capacity = self.capacity(ratio)
            cu_comp, local, entry_row, vis_start, vis_end = entry_layout(self.rows(device), ratio, capacity)
            valid = torch.arange(capacity, device=cu_comp.device) < cu_comp[-1]
            zero = local.new_zeros(())
            self._cache[key] = CaptureSafeCompressMeta(
                ratio=ratio,
                capacity=capacity,
                max_visible=min(self.max_seqlen // ratio, capacity),
                cu_comp=cu_comp,
                entry_row=torch.where(valid, entry_row, zero),
                entry_first=(local == 0) | ~valid,
                entry_pos=torch.where(valid, local * ratio, zero),
                entry_valid=valid,
                vis_start=vis_start,
                vis_end=vis_end,
                num_entries=cu_comp[-1],
            )
        return self._cache[key]

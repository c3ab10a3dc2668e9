"""Packed variable-length sequences (THD layout).

Many documents are packed into one token stream ``[T, ...]``. Two prefix sums describe it:

* ``cu_seqlens_padded`` (physical): document ``b`` occupies rows ``[cu[b], cu[b+1])``. All addressing
  (positions, windows, compression blocks) uses these.
* ``cu_seqlens`` (real): document ``b`` has ``cu_real[b+1] - cu_real[b]`` real tokens, stored at the start of
  its physical span; the remaining rows are padding. Padding rows attend to nothing (their output is
  zero), make no compressed entry, and are excluded from losses, so they never change a real row.

Everything derived from the prefix sums is computed once and cached on the object, so one ``PackedSeqs``
per step can be handed to every layer. The cache remembers the prefix sums' version counters: editing one in
place (or assigning a new one) empties it, so a stale layout is never reused.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "PackedSeqs", "RowMeta", "CompressMeta", "validate_cu_seqlens", "row_layout", "entry_layout",
]


def validate_cu_seqlens(
    cu: Any, name: str, num_rows: int | None = None, device: torch.device | None = None
) -> Tensor:
    """Check a ``cu_seqlens`` tensor and return it as int64.

    Raises ``ValueError`` naming ``name`` when it is not an int32/int64 1-D tensor with at least two
    entries that starts at 0, never decreases, ends at ``num_rows`` and lives on ``device``.
    """
    if not isinstance(cu, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-D [num_docs + 1], got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries (one document), got {cu.numel()}")
    if device is not None and cu.device != torch.device(device):
        raise ValueError(f"{name} is on {cu.device} but the hidden states are on {device}")
    host = cu.detach().to("cpu", torch.int64)
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {host.tolist()[:16]}")
    if num_rows is not None and int(host[-1]) != num_rows:
        raise ValueError(f"{name}[-1] = {int(host[-1])} must equal the number of rows ({num_rows})")
    return cu.to(torch.int64)


def row_layout(cu_padded: Tensor, cu_real: Tensor, num_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row document id, position and real flag, plus per-document start row and real length.

    Pure device work (no host read), shared by :class:`PackedSeqs` and the capture-safe metadata.

    Returns:
        ``doc [T]``, ``pos [T]``, ``real [T]`` (bool), ``doc_start [N]``, ``real_len [N]`` (int64).
    """
    pad = cu_padded.to(torch.int64)
    real = cu_real.to(device=pad.device, dtype=torch.int64)
    row = torch.arange(num_rows, device=pad.device)
    doc = torch.bucketize(row, pad[1:], right=True).clamp_(max=pad.numel() - 2)
    pos = row - pad[doc]
    real_len = real[1:] - real[:-1]
    return doc, pos, pos < real_len[doc], pad[:-1], real_len


def entry_layout(
    rows: Any, ratio: int, num_slots: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Compressed-entry layout of ratio ``r`` (document ``b`` yields ``real_len[b] // r`` entries).

    Args:
        rows: a :class:`RowMeta`-like object (``doc``, ``pos``, ``real``, ``doc_start``, ``real_len``).
        ratio: r.
        num_slots: entry slots to lay out; None = exactly the real entries (one host read of their count).
            Slots past the real count belong to no document (their ``local`` is meaningless).

    Returns:
        ``cu_comp [N+1]``, ``local [slots]`` (entry index inside its document), ``entry_row [slots]`` (first row
        of the entry's block), ``vis_start [T]``, ``vis_end [T]`` (the ids row t may see).
    """
    n_comp = rows.real_len // ratio
    cu_comp = torch.cat([n_comp.new_zeros(1), n_comp.cumsum(0)])
    if num_slots is None:
        num_slots = int(cu_comp[-1])
    entry = torch.arange(num_slots, device=cu_comp.device)
    entry_doc = torch.bucketize(entry, cu_comp[1:], right=True).clamp_(max=n_comp.numel() - 1)
    local = entry - cu_comp[entry_doc]
    visible = torch.minimum((rows.pos + 1) // ratio, n_comp[rows.doc])
    visible = torch.where(rows.real, visible, torch.zeros_like(visible))
    vis_start = cu_comp[rows.doc]
    return cu_comp, local, rows.doc_start[entry_doc] + local * ratio, vis_start, vis_start + visible


_INT32_MAX = 2**31 - 1


def _prefix_sum(lengths: Any, name: str) -> Tensor:
    """``[0, cumsum(lengths)]`` int64 after checking ``lengths`` are non-negative integers whose total fits the
    int32 ``cu_seqlens`` (a float would be truncated and an overflow wrap around without a word)."""
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"{name} must be a list of ints or a 1-D integer tensor, got a {lengths.dtype} tensor of "
                             f"shape {tuple(lengths.shape)}")
        values = lengths.tolist()
    else:
        try:
            values = list(lengths)
        except TypeError:
            raise ValueError(f"{name} must be a list of ints (one per document), got "
                             f"{type(lengths).__name__}") from None
    for i, n in enumerate(values):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ValueError(f"{name}[{i}] = {n!r} is not an integer: {name} counts tokens (got a "
                             f"{type(n).__name__}; round it yourself, e.g. int({n!r}), if that is what you mean)")
        if n < 0:
            raise ValueError(f"{name}[{i}] = {n} must be >= 0")
    total = sum(int(n) for n in values)
    if total > _INT32_MAX:
        raise ValueError(f"{name} sum to {total} tokens, past the int32 range of cu_seqlens (at most {_INT32_MAX}): "
                         "split the pack")
    return torch.tensor([0, *(int(n) for n in values)], dtype=torch.int64).cumsum(0)


@dataclass
class RowMeta:
    """Per-row facts of a packed stream (all ``[T]`` unless noted)."""

    doc: Tensor  # int64 document id of each row
    pos: Tensor  # int64 position of the row inside its document (0-based, physical)
    real: Tensor  # bool, True for real (non-padding) rows
    doc_start: Tensor  # [N] int64 first physical row of each document
    real_len: Tensor  # [N] int64 real length of each document
    num_real: int  # host int: number of real rows


@dataclass
class CompressMeta:
    """Compressed entries for one ratio ``r``: document ``b`` yields ``real_len[b] // r`` entries."""

    ratio: int
    cu_comp: Tensor  # [N+1] int64 prefix sum of entries per document
    entry_row: Tensor  # [Nc] int64 physical row of the first token of each entry's block
    entry_first: Tensor  # [Nc] bool, True for the first entry of its document (no previous block)
    entry_pos: Tensor  # [Nc] int64 position of the entry's first token inside its document (= i * r)
    vis_start: Tensor  # [T] int64 first compressed id a row may see (its document's first entry)
    vis_end: Tensor  # [T] int64 one past the last visible id: start + min((pos+1)//r, n_comp)
    num_entries: int  # host int
    max_visible: int  # host int: the widest visible range of any row


@dataclass
class PackedSeqs:
    """Packed-sequence metadata.

    Args:
        cu_seqlens: ``[N+1]`` int32/int64 real lengths prefix sum. Defaults to ``cu_seqlens_padded``.
        cu_seqlens_padded: ``[N+1]`` physical layout. Defaults to ``cu_seqlens``.
        max_seqlen: host int, the longest physical document (computed if omitted).

    Example:
        >>> packed = PackedSeqs.from_lengths([5, 3], padded_lengths=[8, 4])
    """

    cu_seqlens: Tensor | None = None
    cu_seqlens_padded: Tensor | None = None
    max_seqlen: int | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    # what the caller called the two prefix sums (error messages name what was passed, see __post_init__)
    _names: tuple[str, str] = field(default=("cu_seqlens", "cu_seqlens_padded"), repr=False, compare=False)
    _stamp: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        real_name, pad_name = self._names
        if self.cu_seqlens is None and self.cu_seqlens_padded is None:
            raise ValueError(f"PackedSeqs needs {real_name} or {pad_name}")
        # One given prefix sum stands for both; errors then name the one the caller passed, not its stand-in.
        if self.cu_seqlens is None:
            self.cu_seqlens = self.cu_seqlens_padded
            self._names = (pad_name, pad_name)
        if self.cu_seqlens_padded is None:
            self.cu_seqlens_padded = self.cu_seqlens
            self._names = (real_name, real_name)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(
        cls,
        lengths: list[int],
        padded_lengths: list[int] | None = None,
        device: torch.device | str | None = None,
    ) -> PackedSeqs:
        """Build from per-document real lengths (and optional physical lengths >= real).

        Args:
            lengths: ``N`` non-negative ints (a list, or a 1-D integer tensor), the real tokens of each document.
            padded_lengths: optional ``N`` ints >= ``lengths``, the rows each document occupies.
            device: where the prefix sums go.

        Raises ``ValueError`` naming the argument for a non-integer or negative length, or a total past the int32
        range of the prefix sums.
        """
        real = _prefix_sum(lengths, "lengths")
        padded = real if padded_lengths is None else _prefix_sum(padded_lengths, "padded_lengths")
        if padded_lengths is not None and padded.numel() != real.numel():
            raise ValueError(f"padded_lengths has {padded.numel() - 1} documents but lengths has {real.numel() - 1}")
        out = cls(
            cu_seqlens=real.to(torch.int32).to(device),
            cu_seqlens_padded=padded.to(torch.int32).to(device),
            max_seqlen=int((padded[1:] - padded[:-1]).max()) if len(lengths) else 0,
        )
        return out

    @classmethod
    def uniform(cls, batch: int, seqlen: int, device: torch.device | str | None = None) -> PackedSeqs:
        """``batch`` documents of ``seqlen`` tokens each (the ``[B, S, D]`` layout)."""
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
        return cls(cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=seqlen)

    @classmethod
    def coerce(cls, packed: Any) -> PackedSeqs:
        """Accept a ``PackedSeqs`` or any object with Megatron ``PackedSeqParams`` fields
        (``cu_seqlens_q``, ``cu_seqlens_q_padded``, ``max_seqlen_q``; either cu may be None)."""
        if isinstance(packed, PackedSeqs):
            return packed
        cu = getattr(packed, "cu_seqlens_q", None)
        cu_pad = getattr(packed, "cu_seqlens_q_padded", None)
        if cu is None and cu_pad is None:
            raise ValueError(
                "packed must be a csattn.PackedSeqs or have cu_seqlens_q / cu_seqlens_q_padded, "
                f"got {type(packed).__name__} with neither"
            )
        max_seqlen = getattr(packed, "max_seqlen_q", None)
        return cls(cu_seqlens=cu, cu_seqlens_padded=cu_pad, max_seqlen=max_seqlen,
                   _names=("packed.cu_seqlens_q", "packed.cu_seqlens_q_padded"))

    # ------------------------------------------------------------------ cache
    def _version_stamp(self) -> tuple:
        """Identity and in-place version counter of both prefix sums (and ``max_seqlen``)."""
        def one(t: Any) -> tuple:
            try:
                return id(t), t._version
            except (AttributeError, RuntimeError):  # not a tensor, or an inference tensor: no version counter
                return id(t), None
        return one(self.cu_seqlens), one(self.cu_seqlens_padded), self.max_seqlen

    def cache(self) -> dict:
        """The derived-metadata cache, emptied first when a prefix sum was edited in place (its ``_version``
        counter moved), replaced, or ``max_seqlen`` changed since the cache was filled: a layout derived from
        the old values must never be reused for new ones."""
        stamp = self._version_stamp()
        if stamp != self._stamp:
            self._cache.clear()
            self._stamp = stamp
        return self._cache

    # ------------------------------------------------------------------ validation
    def validate(self, num_rows: int, device: torch.device) -> None:
        """Check both prefix sums against the stream (``ValueError`` naming the argument as it was passed)."""
        cache = self.cache()
        key = ("validated", num_rows, str(device))
        if key in cache:
            return
        real_name, pad_name = self._names
        pad = validate_cu_seqlens(self.cu_seqlens_padded, pad_name, num_rows, device)
        real = pad if self.cu_seqlens is self.cu_seqlens_padded else validate_cu_seqlens(
            self.cu_seqlens, real_name, None, device)
        if real.numel() != pad.numel():
            raise ValueError(
                f"{real_name} has {real.numel() - 1} documents but {pad_name} has {pad.numel() - 1}"
            )
        real_len = real[1:] - real[:-1]
        pad_len = pad[1:] - pad[:-1]
        if bool((pad_len < real_len).any()):
            raise ValueError(
                f"{pad_name} describes a document shorter than its real length in {real_name} "
                f"(padded lengths {pad_len.tolist()[:16]}, real lengths {real_len.tolist()[:16]})"
            )
        if self.max_seqlen is not None and int(pad_len.max()) > int(self.max_seqlen):
            raise ValueError(f"max_seqlen = {self.max_seqlen} is below the longest document ({int(pad_len.max())})")
        cache[key] = True

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens_padded.numel() - 1

    @property
    def num_rows(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    def host_max_seqlen(self) -> int:
        """The given ``max_seqlen``, or the longest physical document (computed once per prefix-sum version)."""
        if self.max_seqlen is not None:
            return int(self.max_seqlen)
        cache = self.cache()
        if "max_seqlen" not in cache:
            pad = self.cu_seqlens_padded.to(torch.int64)
            cache["max_seqlen"] = int((pad[1:] - pad[:-1]).max())
        return cache["max_seqlen"]

    # ------------------------------------------------------------------ derived metadata
    def rows(self, device: torch.device | None = None) -> RowMeta:
        """Per-row document id, position and real flag (cached)."""
        device = device or self.cu_seqlens_padded.device
        cache = self.cache()
        key = ("rows", str(device))
        if key not in cache:
            pad = self.cu_seqlens_padded.to(device=device)
            doc, pos, real, doc_start, real_len = row_layout(pad, self.cu_seqlens, int(pad[-1]))
            cache[key] = RowMeta(doc, pos, real, doc_start, real_len, int(real_len.sum()))
        return cache[key]

    def compress(self, ratio: int, device: torch.device | None = None) -> CompressMeta:
        """Compressed-entry layout for ``ratio`` (cached)."""
        if ratio < 1:
            raise ValueError(f"compress ratio must be >= 1, got {ratio}")
        device = device or self.cu_seqlens_padded.device
        cache = self.cache()
        key = ("compress", ratio, str(device))
        if key not in cache:
            cu_comp, local, entry_row, vis_start, vis_end = entry_layout(self.rows(device), ratio)
            max_visible = int((vis_end - vis_start).max()) if vis_end.numel() else 0
            cache[key] = CompressMeta(
                ratio=ratio,
                cu_comp=cu_comp,
                entry_row=entry_row,
                entry_first=local == 0,
                entry_pos=local * ratio,
                vis_start=vis_start,
                vis_end=vis_end,
                num_entries=local.numel(),
                max_visible=max_visible,
            )
        return cache[key]

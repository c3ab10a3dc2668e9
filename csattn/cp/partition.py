"""Which rows of the global packed stream each CP rank owns, and how much attention work that gives it.

The stream of ``T`` rows is cut into ``K`` equal chunks of ``C = T / K`` rows and every chunk is given to
one rank; a rank's rows are its chunks in stream order (adjacent chunks merge into one *segment*). Every
rank owns the same number of rows, so per-rank activation memory is the same everywhere.

* ``"contiguous"``: ``K = P``, chunk r -> rank r (Megatron's THD split, rank r owns ``[r*L, (r+1)*L)``).
* ``"balanced"``: ``K = m * P`` (``m = chunks_per_rank``, default 4) and the chunks are dealt out by
  work, heaviest first, each to the least-loaded rank that still has room for a chunk (longest processing
  time first with equal chunk counts). A chunk's work is the indexer + attention FLOPs of its rows, which
  grow with each row's position inside its document, so late chunks of long documents are heavy. On a
  single long document this reproduces the zigzag layout (rank r gets chunks r and 2P-1-r for m = 2); on
  mixed packs it balances what zigzag cannot. See README.md.

Everything here is host-side integer arithmetic on the global metadata, so every rank computes the same
layout for every other rank without communicating (and bit-identically: no floating point involved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import AttentionConfig
from ..packing import PackedSeqs

__all__ = [
    "PARTITIONS",
    "Layout",
    "make_layout",
    "contiguous_layout",
    "num_chunks",
    "halo_rows",
    "row_flops",
    "partition_flops",
    "flop_imbalance",
]

PARTITIONS: tuple[str, ...] = ("contiguous", "balanced")


def _check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")


def num_chunks(partition: str, size: int, chunks_per_rank: int = 4) -> int:
    """Equal-size chunks the stream is cut into: ``P`` (contiguous) or ``chunks_per_rank * P`` (balanced)."""
    _check_partition(partition)
    return size if partition == "contiguous" else chunks_per_rank * size


@dataclass(frozen=True)
class Layout:
    """Row ownership of one packed stream over ``size`` ranks."""

    num_rows: int
    size: int
    chunk: int  # rows per chunk
    chunk_owner: tuple[int, ...]  # [K] rank of each chunk

    def segments(self, rank: int) -> list[tuple[int, int]]:
        """Global row ranges ``[(a, b), ...]`` owned by ``rank``: sorted, adjacent chunks merged."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        segs: list[tuple[int, int]] = []
        for c, owner in enumerate(self.chunk_owner):
            if owner != rank:
                continue
            a, b = c * self.chunk, (c + 1) * self.chunk
            if segs and segs[-1][1] == a:
                segs[-1] = (segs[-1][0], b)
            else:
                segs.append((a, b))
        return segs

    def local_rows(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """``[T / P]`` int64 global row of each of ``rank``'s local rows, in local order."""
        parts = [torch.arange(a, b, device=device) for a, b in self.segments(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def owner(self, rows: Tensor) -> Tensor:
        """Rank owning each global row of ``rows`` (int64, same shape)."""
        table = torch.tensor(self.chunk_owner, dtype=torch.int64, device=rows.device)
        return table[rows // max(self.chunk, 1)]


def chunk_costs(packed: PackedSeqs, num_chunk: int, cost_config: AttentionConfig) -> list[int]:
    """Integer work (FLOPs, :func:`row_flops`) of each of ``num_chunk`` equal chunks."""
    flops = row_flops(packed, cost_config)
    return flops.view(num_chunk, -1).sum(1).tolist()


def make_layout(
    packed: PackedSeqs,
    partition: str,
    size: int,
    chunks_per_rank: int = 4,
    cost_config: AttentionConfig | None = None,
) -> Layout:
    """The :class:`Layout` of ``packed`` (cached on it). ``T`` must be divisible by :func:`num_chunks`."""
    _check_partition(partition)
    k = num_chunks(partition, size, chunks_per_rank)
    key = ("cp-layout", partition, size, chunks_per_rank, id(cost_config))
    cached = packed.cache().get(key)
    if cached is not None:
        return cached
    num_rows = packed.num_rows
    if num_rows % k:
        raise ValueError(f"the packed stream has {num_rows} rows, not divisible into {k} chunks")
    if partition == "contiguous":
        layout = contiguous_layout(num_rows, size)
    else:
        costs = chunk_costs(packed, k, cost_config or AttentionConfig())
        owner = [0] * k
        load, count = [0] * size, [0] * size
        # heaviest chunk first to the least-loaded rank with room; ties to the lower chunk / rank id
        for c in sorted(range(k), key=lambda i: (-costs[i], i)):
            r = min((r for r in range(size) if count[r] < chunks_per_rank), key=lambda r: (load[r], r))
            owner[c] = r
            load[r] += costs[c]
            count[r] += 1
        layout = Layout(num_rows=num_rows, size=size, chunk=num_rows // k, chunk_owner=tuple(owner))
    packed.cache()[key] = layout
    return layout


def contiguous_layout(num_rows: int, size: int) -> Layout:
    """Rank r owns rows ``[r T / P, (r + 1) T / P)``: from host ints alone, so the capture-safe plan can use it.
    ``T`` must be divisible by ``P``."""
    return Layout(num_rows=num_rows, size=size, chunk=num_rows // size, chunk_owner=tuple(range(size)))


def halo_rows(cfg: AttentionConfig) -> int:
    """Rows of left context a segment needs from the rows before it.

    The window of a segment's first row reaches ``W - 1`` rows back; a compressed group owned by the segment
    (its last token is in the segment) starts ``r - 1`` rows back, or ``2r - 1`` with the overlapping (CSA)
    compressor, which also pools the previous block.
    """
    need = cfg.sliding_window - 1
    if cfg.layer_type == "csa":
        need = max(need, 2 * cfg.compress_ratio - 1)
    elif cfg.layer_type == "hca":
        need = max(need, cfg.compress_ratio - 1)
    return need


# ---------------------------------------------------------------------------------- work model
def row_flops(packed: PackedSeqs, cfg: AttentionConfig) -> Tensor:
    """Forward FLOPs of indexer scoring + sparse attention for every global row, ``[T]`` int64.

    * attention: ``4 * H * d`` per attended key (QK and PV); keys = window keys + compressed keys
      (HCA: every visible entry; CSA: ``min(k, visible)``);
    * indexer (CSA): ``2 * HI * (cI + 1)`` per visible entry (the ``q . k`` dots, then the ReLU-weighted
      head sum).

    Projections cost the same per row on every rank (equal row counts), so they do not affect the balance
    and are left out. Padding rows do no work.
    """
    rows = packed.rows(torch.device("cpu"))
    window = torch.minimum(rows.pos + 1, torch.full_like(rows.pos, cfg.sliding_window))
    keys = torch.where(rows.real, window, torch.zeros_like(window))
    index = torch.zeros_like(keys)
    if cfg.layer_type != "sliding":
        meta = packed.compress(cfg.compress_ratio, torch.device("cpu"))
        visible = meta.vis_end - meta.vis_start
        if cfg.layer_type == "hca":
            keys = keys + visible
        else:
            keys = keys + visible.clamp(max=cfg.index_topk)
            index = 2 * cfg.index_n_heads * (cfg.index_head_dim + 1) * visible
    return 4 * cfg.num_heads * cfg.head_dim * keys + index


def partition_flops(layout: Layout, packed: PackedSeqs, cfg: AttentionConfig) -> Tensor:
    """Indexer + attention forward FLOPs of each rank under ``layout``, ``[P]`` int64."""
    flops = row_flops(packed, cfg)
    owner = layout.owner(torch.arange(flops.numel()))
    return torch.zeros(layout.size, dtype=torch.int64).index_add_(0, owner, flops)


def flop_imbalance(per_rank: Tensor) -> float:
    """``max / min - 1`` of per-rank work (0 = perfectly balanced)."""
    lo = float(per_rank.min())
    return float("inf") if lo <= 0 else float(per_rank.max()) / lo - 1.0

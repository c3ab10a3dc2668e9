"""The capture-safe plan under context parallelism (contiguous partition): no host sync, static shapes.

The default CP path (``csattn/cp``) plans each rank's work on the host from the document boundaries: which
compressed groups the rank owns, how many entries every rank sends, their global order. Here every shape is
fixed by ``T``, ``P``, the number of documents and ``max_seqlen``, and the rest is computed on the device:

* rank ``p`` holds rows ``[p L, (p + 1) L)``, ``L = T / P`` (``partition.contiguous_layout``), and receives
  the ``Hh`` rows before them (one all-gather of every rank's last ``Hh`` rows, reduce-scatter backward); the
  halo rows and the rank's rows are projected piece by piece (``RowPieces``);
* every rank pools the entries it owns (last token among its rows) over the **global** static entry capacity,
  with the other slots pooling a zero scratch block (so they are exactly zero), and one all-reduce (sum) of
  ``[capacity, d + cI]`` assembles all entries in global id order on every rank (each slot has one nonzero
  term, so the sum is exact);
* window ids, visible ranges, the top-k and the loss weight (global real-row count on the device) come from the
  static global metadata, sliced to the rank's rows.

The balanced partition deals chunks by document lengths on the host, so it is not capture-safe: the one check
below refuses it. The input
agreement check (same ``T``, shard rows, halo) is a collective that reads its result on the host: it runs on
every eager call (never conditioned on a per-object cache, which could differ between ranks), and not while a
CUDA graph is being captured, ``torch.compile`` traces or ``NoHostSync`` is active (a captured step is warmed
up eagerly first).
A CUDA-graph capture needs collectives that can be captured (NCCL); gloo's copy through host memory cannot be.
"""

from __future__ import annotations

from torch import Tensor

from ..config import AttentionConfig
from ..layers.op_sets import CAPTURE_SAFE
from ..layers.plan import ContextParallelGroup, Entries, LayerPlan
from ..nosync import host_reads_forbidden
from ..ops.indices import window_indices
from ..packing_capture_safe import CaptureSafePackedSeqs
from .exchange import AllReduceExchange
from .partition import contiguous_layout, halo_rows
from .plan import _fingerprint, agree

__all__ = ["build_capture_safe_plan", "check_capture_safe_inputs"]


def check_capture_safe_inputs(x_local: Tensor, static: CaptureSafePackedSeqs, cfg: AttentionConfig,
                              cp: ContextParallelGroup) -> tuple[int, int]:
    """``(L, Hh)``; every rank raises the same ValueError on bad input (eager calls only)."""
    size, total = cp.size, static.num_rows
    halo = halo_rows(cfg)
    rows = total // size if size else 0
    problems = []
    if cp.partition != "contiguous":
        problems.append(f"capture-safe context parallelism needs partition='contiguous' (got {cp.partition!r}: "
                        "the balanced partition deals chunks by document lengths on the host)")
    if cfg.layer_type == "csa" and cfg.indexer_loss_type == "dense":
        problems.append("the dense indexer loss is not capture-safe under context parallelism (use 'sparse')")
    if total % size:
        problems.append(f"packed.num_rows = {total} does not split into {size} equal shards")
    elif size > 1 and rows < halo:
        problems.append(f"a shard of {rows} rows is shorter than the {halo}-row left halo of this layer")
    if x_local.shape[0] != rows:
        problems.append(f"hidden_states has {x_local.shape[0]} rows on rank {cp.rank}, expected T / P = {rows}")
    # The agreement collective runs on every eager call: skipping it because this object passed before would
    # leave a rank that got a fresh object waiting in it alone. It is skipped only where no host read may
    # happen (capture, compile, NoHostSync), modes every rank enters together; there a problem raises locally.
    if not host_reads_forbidden(x_local):
        geometry = (cfg.layer_type, cfg.sliding_window, cfg.compress_ratio, total, static.max_seqlen, cp.partition)
        try:  # same metadata and layer on every rank: [max, -min] of a fingerprint tells
            fp = _fingerprint(static, geometry)
        except Exception:  # unreadable metadata; the layer's own checks name the problem
            fp = 0
        failed, same = agree(1 if problems else 0, fp, x_local.device, cp.group)
        if failed > 0:
            detail = "; ".join(problems) if problems else "another rank got bad input"
            raise ValueError(f"context parallelism (capture-safe): {detail}")
        if not same:
            raise ValueError(
                "context parallelism (capture-safe): the global packed metadata (cu_seqlens / cu_seqlens_padded, "
                "num_rows, max_seqlen) or the layer geometry differs across the ranks of the CP group; every "
                "rank must pass the same global packed metadata and run the same layer")
    elif problems:
        raise ValueError(f"context parallelism (capture-safe): {'; '.join(problems)}")
    return rows, halo


def build_capture_safe_plan(x_local: Tensor, static: CaptureSafePackedSeqs, cfg: AttentionConfig,
                            cp: ContextParallelGroup) -> LayerPlan:
    """This rank's capture-safe plan: local rows, halo rows and the entries it owns from its rows of the
    contiguous layout; visible ranges, window ids and the global real-row count from the static global metadata.

    Args:
        x_local: ``[T / P, D]`` this rank's rows (``cp.shard`` with the contiguous partition).
        static: the global stream's :class:`CaptureSafePackedSeqs`, identical on every rank.
        cfg: the layer's geometry. cp: a ``csattn.ContextParallel`` with ``partition="contiguous"``.
    """
    _, halo = check_capture_safe_inputs(x_local, static, cfg, cp)
    device = x_local.device
    (lo, hi), = contiguous_layout(static.num_rows, cp.size).segments(cp.rank)
    h = halo if lo > 0 else 0
    rows = static.rows(device)
    pos_ext, real_ext = rows.pos[lo - h:hi], rows.real[lo - h:hi]
    # window ids in ext rows; every local row reaches at most W - 1 <= Hh rows back, so its ids stay >= 0
    window_ids = window_indices(pos_ext, real_ext, cfg.sliding_window)[h:]
    entries = None
    if cfg.has_compressor:
        meta = static.compress(cfg.compress_ratio, device)
        last_row = meta.entry_row + cfg.compress_ratio - 1
        owned = meta.entry_valid & (last_row >= lo) & (last_row < hi)  # the others come out exactly zero
        entries = Entries(meta, meta.vis_start[lo:hi], meta.vis_end[lo:hi], meta.max_visible, keep=owned,
                          ext_rows=hi - lo + h, shift=lo - h)
    return LayerPlan(rows.pos[lo:hi], rows.real[lo:hi], rows.num_real, window_ids,
                     AllReduceExchange(cp.rank, cp.size, halo, cp.group), CAPTURE_SAFE, pos_ext=pos_ext,
                     entries=entries)

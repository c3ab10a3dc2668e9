"""Capture-safe forward under context parallelism (contiguous partition): no host sync, static shapes.

The default CP path (``csattn/cp``) plans each rank's work on the host from the document boundaries: which
compressed groups the rank owns, how many entries every rank sends, their global order. Here every shape is
fixed by ``T``, ``P``, the number of documents and ``max_seqlen``, and the rest is computed on the device:

* rank ``p`` holds rows ``[p L, (p + 1) L)``, ``L = T / P``, and receives the ``Hh`` rows before them (one
  all-gather of every rank's last ``Hh`` rows, reduce-scatter backward); the halo rows and the rank's rows are
  projected piece by piece (``RowPieces``);
* every rank pools the entries it owns (last token among its rows) over the **global** static entry capacity,
  with the other slots pooling a zero scratch block (so they are exactly zero), and one all-reduce (sum) of
  ``[capacity, d + cI]`` assembles all entries in global id order on every rank (each slot has one nonzero
  term, so the sum is exact);
* window ids, visible ranges, the top-k and the loss weight (global real-row count on the device) come from the
  static global metadata, sliced to the rank's rows.

The balanced partition deals chunks by document lengths on the host, so it is not capture-safe. The input
agreement check (same ``T``, shard rows, halo) is a collective that reads its result on the host: it runs on
every eager call (never conditioned on a per-object cache, which could differ between ranks), and not while a
CUDA graph is being captured, ``torch.compile`` traces or ``NoHostSync`` is active (a captured step is warmed
up eagerly first).
A CUDA-graph capture needs collectives that can be captured (NCCL); gloo's copy through host memory cannot be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

from ..cp.gather import start_gather_rows
from ..cp.partition import halo_rows
from ..cp.plan import _fingerprint
from ..layers.attention import CompressedRange, IndexerLossInputs
from ..layers.modules import RowPieces
from ..ops.indexer.custom_ops import indexer_topk_static_op
from ..ops.indices import window_indices
from .forward import _compress, _loss_scale
from .nosync import host_reads_forbidden
from .static import StaticPackedSeqs

if TYPE_CHECKING:
    from ..layers.attention import HybridAttention

__all__ = ["capture_safe_cp_forward"]


def _check(layer: HybridAttention, x_local: Tensor, static: StaticPackedSeqs, cp: Any) -> tuple[int, int]:
    """``(L, Hh)``; every rank raises the same ValueError on bad input (eager calls only)."""
    size, total = cp.size, static.num_rows
    halo = halo_rows(layer.config)
    rows = total // size if size else 0
    problems = []
    if cp.partition != "contiguous":
        problems.append(f"capture-safe context parallelism needs partition='contiguous' (got {cp.partition!r}: "
                        "the balanced partition deals chunks by document lengths on the host)")
    if layer.config.layer_type == "csa" and layer.config.indexer_loss_type == "dense":
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
        cfg = layer.config
        geometry = (cfg.layer_type, cfg.sliding_window, cfg.compress_ratio, total, static.max_seqlen, cp.partition)
        try:  # same metadata and layer on every rank: [max, -min] of a fingerprint tells
            fp = _fingerprint(static, geometry)
        except Exception:  # unreadable metadata; the layer's own checks name the problem
            fp = 0
        flags = torch.tensor([1 if problems else 0, fp, -fp], dtype=torch.int64, device=x_local.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cp.group)
        failed, fp_max, fp_min = flags.tolist()
        if failed > 0:
            detail = "; ".join(problems) if problems else "another rank got bad input"
            raise ValueError(f"context parallelism (capture-safe): {detail}")
        if fp_max != -fp_min:
            raise ValueError(
                "context parallelism (capture-safe): the global packed metadata (cu_seqlens / cu_seqlens_padded, "
                "num_rows, max_seqlen) or the layer geometry differs across the ranks of the CP group; every "
                "rank must pass the same global packed metadata and run the same layer")
    elif problems:
        raise ValueError(f"context parallelism (capture-safe): {'; '.join(problems)}")
    return rows, halo


def capture_safe_cp_forward(layer: HybridAttention, x_local: Tensor, static: StaticPackedSeqs, cp: Any) -> Tensor:
    """This rank's output rows ``[T / P, D]`` for its input rows ``x_local [T / P, D]``.

    Args:
        layer: the attention layer.
        x_local: rows ``[p T / P, (p + 1) T / P)`` of the global stream (``cp.shard`` with the contiguous partition).
        static: the global stream's :class:`StaticPackedSeqs`, identical on every rank.
        cp: a :class:`csattn.ContextParallel` with ``partition="contiguous"``.

    Returns:
        ``[T / P, D]``; equal to the default CP path and to the single-process layer's rows.
    """
    cfg = layer.config
    rows_per_rank, halo = _check(layer, x_local, static, cp)
    device = x_local.device
    backend = layer.backend_for(x_local)
    lo = cp.rank * rows_per_rank
    hi = lo + rows_per_rank
    h = halo if cp.rank > 0 else 0
    rows = static.rows(device)

    tails = start_gather_rows(x_local[rows_per_rank - halo:], cp.group) if cp.size > 1 and halo > 0 else None
    cos, sin = layer.rope_tables(rows.pos[lo:hi], x_local.dtype)
    qr = layer.query_latent(x_local)  # overlaps the halo exchange
    if tails is None:
        x_ext: Tensor | RowPieces = x_local
    else:
        received = tails.wait()  # [P * Hh, D]; rank p's halo is rank p - 1's tail
        # rank 0 keeps an empty slice so it joins the exchange's backward collective like every other rank;
        # copied out so that the saved halo does not keep every rank's tails alive (see cp/halo.py)
        mine = received[(cp.rank - 1) * halo:cp.rank * halo] if h else received[:0]
        x_ext = RowPieces((mine.clone(), x_local))
    n_ext = rows_per_rank + h
    pos_ext, real_ext = rows.pos[lo - h:hi], rows.real[lo - h:hi]
    # window ids in ext rows; every local row reaches at most W - 1 <= Hh rows back, so its ids stay >= 0
    window_ids = window_indices(pos_ext, real_ext, cfg.sliding_window)[h:]
    cos_e, sin_e = layer.rope_tables(pos_ext, x_local.dtype)
    kv = layer.raw_kv(x_ext, cos_e, sin_e)

    ckv = compressed_ids = loss = None
    if layer.compressor is not None:
        meta = static.compress(cfg.compress_ratio, device)
        last_row = meta.entry_row + cfg.compress_ratio - 1
        owned = meta.entry_valid & (last_row >= lo) & (last_row < hi)
        shift = lo - h
        # slots another rank owns come out exactly zero (see _compress)
        parts = [_compress(layer.compressor, x_ext, n_ext, meta, layer.inv_freq, backend, keep=owned, shift=shift)]
        if cfg.layer_type == "csa":
            x_det = x_ext.detach()  # the indexer learns from its loss only
            parts.append(_compress(layer.compressor.indexer, x_det, n_ext, meta, layer.inv_freq, backend, keep=owned,
                                   shift=shift).to(parts[0].dtype))
        entries = torch.cat(parts, dim=1)
        if cp.size > 1:
            entries = all_reduce_with_grad(entries, group=cp.group)  # one nonzero term per slot
        ckv = entries[:, : cfg.head_dim].contiguous()
        vis_start, vis_end = meta.vis_start[lo:hi], meta.vis_end[lo:hi]
        if cfg.layer_type == "hca":
            compressed_ids = CompressedRange(vis_start, vis_end, meta.max_visible)
        else:
            keys = entries[:, cfg.head_dim:].contiguous()
            indexer = layer.compressor.indexer
            q_idx = indexer.queries(qr.detach(), cos, sin, chunk_rows=layer.indexer_query_rows())
            w = indexer.scorer(x_local.detach())
            compressed_ids = indexer_topk_static_op(q_idx, w, keys, vis_start, vis_end,
                                                    layer.effective_topk(meta.max_visible),
                                                    meta.max_visible, cfg.workspace_bytes, layer.backend_for(q_idx))
            loss = IndexerLossInputs(q_idx, w, keys, rows.real[lo:hi], rows.num_real, vis_start, vis_end)
    return layer.heads(qr, cos, sin, kv, ckv, window_ids, compressed_ids, loss, loss_scale=_loss_scale())

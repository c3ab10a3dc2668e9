"""Capture-safe forward of :class:`csattn.layers.attention.HybridAttention` (single process).

The same phases as ``HybridAttention.forward_packed``, with every host decision replaced by a static bound:

* metadata from :class:`StaticPackedSeqs` (device tensors, host ints only for shapes);
* compressed entries over the static capacity, visible ranges bounded by ``max_seqlen // r``;
* indexer top-k and the dense indexer loss over row chunks of a fixed height (no ``row_chunks`` slabs);
* the loss weight ``1 / num_real_rows`` divided on the device;
* the indexer loss scale (``IndexerLossAutoScaler.set_loss_scale``) read when the forward runs, so a captured
  graph or compiled function keeps the scale it was built with.

The ops are called through their ``torch.library`` custom ops, so ``torch.compile`` sees opaque nodes with
fake implementations; in eager mode they run the same implementations as the default path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layers.attention import CompressedRange, IndexerLossInputs
from ..layers.modules import RowPieces, map_rows
from ..ops.compressor.custom_ops import compress_pool_op
from ..ops.indexer.custom_ops import indexer_topk_static_op
from ..ops.indexer_loss import IndexerLossAutoScaler, attach_indexer_loss
from ..ops.indexer_loss.custom_ops import indexer_kl_loss_op
from ..ops.indices import window_indices
from ..ops.sparse_attn.custom_ops import sparse_attn_op
from .projections import output_proj_op, query_heads_op
from .static import StaticCompressMeta, StaticPackedSeqs

if TYPE_CHECKING:
    from ..layers.attention import HybridAttention
    from ..layers.modules import Compressor

__all__ = ["capture_safe_forward", "capture_safe_forward_packed"]


@torch.compiler.assume_constant_result
def _loss_scale() -> float:
    scale = IndexerLossAutoScaler.main_loss_backward_scale
    return 1.0 if scale is None else float(scale)


def _attach_indexer_loss(output: Tensor, loss: Tensor) -> Tensor:
    # the scale is frozen in the forward: a constant to torch.compile and to a captured graph
    return attach_indexer_loss(output, loss, _loss_scale())


def _queries(layer: HybridAttention, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``HybridAttention.queries`` with the recomputed head projection as a custom op."""
    cfg = layer.config
    if not cfg.recompute_projections:
        return layer.queries(x, cos, sin)
    qr = layer.q_a_norm(layer.q_a_proj(x))
    q = query_heads_op(qr, cos, sin, layer.q_b_proj.weight, cfg.num_heads, cfg.rms_norm_eps, layer.recompute_rows())
    return q, qr


def _output(layer: HybridAttention, o: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``HybridAttention.output`` with the recomputed projection as a custom op."""
    cfg = layer.config
    if not cfg.recompute_projections:
        return layer.output(o, cos, sin)
    return output_proj_op(o, cos, sin, layer.o_a_proj.weight, layer.o_b_proj.weight, cfg.o_groups,
                          layer.recompute_rows())


def capture_safe_forward(layer: HybridAttention, hidden_states: Tensor, packed: Any = None, cp: Any = None) -> Tensor:
    """``HybridAttention.forward`` in capture-safe mode.

    Args:
        hidden_states: ``[B, S, D]`` or packed ``[T, D]``.
        packed: a :class:`StaticPackedSeqs`, or a ``PackedSeqs`` / ``PackedSeqParams`` with a host
            ``max_seqlen`` (turned into one).
        cp: optional ``csattn.ContextParallel`` with the contiguous partition (``hidden_states`` = this rank's
            rows, ``packed`` = the global stream); see :mod:`csattn.graphs.cp_forward`.

    Returns:
        ``[B, S, D]`` or ``[T, D]``, like the input.
    """
    if cp is not None:
        from ..cp import ContextParallel
        from .cp_forward import capture_safe_cp_forward

        if not isinstance(cp, ContextParallel):
            raise ValueError(f"cp= must be a csattn.ContextParallel, got {type(cp).__name__}")

        x_local, _, batch_shape = layer._flatten(hidden_states, None)
        if batch_shape is not None:
            raise ValueError("under cp= hidden_states must be this rank's packed rows [T / P, D]")
        static = packed if isinstance(packed, StaticPackedSeqs) else StaticPackedSeqs.from_packed(
            packed, x_local.shape[0] * cp.size)
        return capture_safe_cp_forward(layer, x_local, static, cp)
    if isinstance(packed, StaticPackedSeqs):
        x, _, batch_shape = layer._flatten(hidden_states, None)
        if batch_shape is not None:
            raise ValueError("packed= is for [T, D] input; got [B, S, D] hidden_states")
        static = packed
    else:
        x, plain, batch_shape = layer._flatten(hidden_states, packed)
        static = StaticPackedSeqs.from_packed(plain, x.shape[0])
    if static.num_rows != x.shape[0]:
        raise ValueError(f"packed.num_rows = {static.num_rows} but hidden_states has {x.shape[0]} rows")
    if static.cu_seqlens_padded.device != x.device:
        raise ValueError(f"cu_seqlens_padded is on {static.cu_seqlens_padded.device} but the hidden states "
                         f"are on {x.device}")
    out = capture_safe_forward_packed(layer, x, static)
    return out.view(*batch_shape, -1) if batch_shape is not None else out


def _compress(comp: Compressor, x: Tensor | RowPieces, num_rows: int, meta: StaticCompressMeta, inv_freq: Tensor,
              backend: str, keep: Tensor | None = None, shift: int = 0) -> Tensor:
    """``Compressor.compress`` over the static capacity through the custom op: ``[capacity, dim]``.

    ``x`` has ``num_rows`` rows; entry ``e`` pools from row ``meta.entry_row[e] - shift``. Slots not in ``keep``
    (default: the tail slots past the real count; under context parallelism also the entries another rank owns)
    pool a zero scratch block appended after the rows, with no previous block, so they come out exactly zero
    and send no gradient to real rows (the fused backward stores, not adds, each row's gradient).
    """
    keep = meta.entry_valid if keep is None else keep
    kv = F.pad(map_rows(comp.kv_proj, x), (0, 0, 0, comp.ratio))
    gate = F.pad(map_rows(comp.gate_proj, x), (0, 0, 0, comp.ratio))
    entry_row = torch.where(keep, meta.entry_row - shift, num_rows)
    entry_first = meta.entry_first | ~keep
    pooled = compress_pool_op(kv, gate, comp.position_bias, entry_row, entry_first, comp.ratio, comp.overlap, backend)
    return comp.finish(pooled, meta.entry_pos, inv_freq)


def capture_safe_forward_packed(layer: HybridAttention, x: Tensor, packed: StaticPackedSeqs) -> Tensor:
    """Forward over a whole packed stream ``x [T, D]`` with no host sync and no data-dependent shape."""
    cfg = layer.config
    backend = layer.backend_for(x)
    rows = packed.rows(x.device)
    cos, sin = layer.rope_tables(rows.pos, x.dtype)
    # Eager and CUDA-graph capture run the block-recomputed core (HybridAttention.heads); under torch.compile the
    # same phases go through the custom ops, which the compiler sees as opaque nodes with fake implementations,
    # and so does the dense indexer loss (its static-bound custom op).
    dense_loss = cfg.layer_type == "csa" and cfg.indexer_loss_type == "dense"
    core = cfg.recompute_projections and not dense_loss and not torch.compiler.is_compiling()
    if core:
        qr = layer.query_latent(x)
        q = None
    else:
        q, qr = _queries(layer, x, cos, sin)
    kv = layer.raw_kv(x, cos, sin)
    window_ids = window_indices(rows.pos, rows.real, cfg.sliding_window)

    ckv = selected = compressed_ids = loss = meta = None
    if layer.compressor is not None:
        meta = packed.compress(cfg.compress_ratio, x.device)
        ckv = _compress(layer.compressor, x, x.shape[0], meta, layer.inv_freq, backend)
        if cfg.layer_type == "hca":
            compressed_ids = CompressedRange(meta.vis_start, meta.vis_end, meta.max_visible)
        else:
            indexer = layer.compressor.indexer
            keys = _compress(indexer, x.detach(), x.shape[0], meta, layer.inv_freq, backend)
            q_idx = indexer.queries(qr.detach(), cos, sin, chunk_rows=layer.indexer_query_rows())
            w = indexer.scorer(x.detach())
            selected = compressed_ids = indexer_topk_static_op(
                q_idx, w, keys, meta.vis_start, meta.vis_end, layer.effective_topk(meta.max_visible),
                meta.max_visible, cfg.workspace_bytes, layer.backend_for(q_idx))
            # the loss weight's count of real rows stays on the device
            loss = IndexerLossInputs(q_idx, w, keys, rows.real, rows.num_real, meta.vis_start, meta.vis_end)
    if core:
        return layer.heads(qr, cos, sin, kv, ckv, window_ids, compressed_ids, loss, loss_scale=_loss_scale())

    def run(q_: Tensor, keys_: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        return sparse_attn_op(q_, keys_, ids, layer.sinks, cfg.scale, cfg.attn_chunk_rows, backend,
                              cfg.sparse_attn_kernel.spec() if cfg.sparse_attn_kernel else "")

    o, lse = layer.attend(q, kv, ckv, window_ids, compressed_ids, run=run)
    layer.last_indexer_loss = None
    if loss is not None and layer.wants_indexer_loss():
        kl = indexer_kl_loss_op(
            loss.q_idx, loss.w, loss.k_idx, q.detach(), ckv.detach(), lse.detach(), cfg.scale,
            loss.row_weight(lse.dtype), selected if cfg.indexer_loss_type == "sparse" else None, meta.vis_start,
            meta.vis_end, meta.max_visible, cfg.workspace_bytes, layer.backend_for(loss.q_idx),
        )
        layer.last_indexer_loss = kl.detach()
        o = _attach_indexer_loss(o, kl * cfg.indexer_loss_coeff)
    return _output(layer, o, cos, sin)

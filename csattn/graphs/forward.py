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
from torch import Tensor

from ..ops.compressor.custom_ops import compress_pool_op
from ..ops.indexer.custom_ops import indexer_topk_static_op
from ..ops.indexer_loss import IndexerLossAutoScaler, attach_indexer_loss
from ..ops.indexer_loss.custom_ops import indexer_kl_loss_op
from ..ops.indices import combine_indices, range_indices, window_indices
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


def _compress(comp: Compressor, x: Tensor, meta: StaticCompressMeta, inv_freq: Tensor, backend: str) -> Tensor:
    """``Compressor.compress`` through the custom op: ``[capacity, dim]``."""
    kv, gate, entry_row = comp.kv_proj(x), comp.gate_proj(x), meta.entry_row
    if backend == "triton" and meta.capacity:
        # The fused backward stores (does not accumulate) each row's gradient, so a tail slot pooling rows
        # [0, r) would overwrite entry 0's. Tail slots there pool a zero scratch block after the stream.
        kv = torch.nn.functional.pad(kv, (0, 0, 0, comp.ratio))
        gate = torch.nn.functional.pad(gate, (0, 0, 0, comp.ratio))
        entry_row = torch.where(meta.entry_valid, entry_row, x.shape[0])
    pooled = compress_pool_op(kv, gate, comp.position_bias, entry_row, meta.entry_first, comp.ratio, comp.overlap,
                              backend)
    return comp.finish(pooled, meta.entry_pos, inv_freq)


def _attend(layer: HybridAttention, q: Tensor, kv: Tensor, ckv: Tensor | None, window_ids: Tensor,
            selected: Tensor | None, meta: StaticCompressMeta | None) -> tuple[Tensor, Tensor]:
    """``HybridAttention.attend`` with the HCA range bounded by the static ``meta.max_visible``."""
    cfg = layer.config
    backend = layer.backend_for(q)

    def run(q_, keys, ids):
        return sparse_attn_op(q_, keys, ids, layer.sinks, cfg.scale, cfg.attn_chunk_rows, backend)

    if ckv is None or ckv.shape[0] == 0:
        return run(q, kv, window_ids)
    keys = torch.cat([kv, ckv.to(kv.dtype)], dim=0)
    if selected is not None:
        return run(q, keys, combine_indices(window_ids, selected, kv.shape[0]))
    width = meta.max_visible
    per_row = window_ids.shape[1] + max(width, 1)
    step = max(1, (cfg.workspace_bytes // 8) // per_row)
    outs, lses = [], []
    for lo in range(0, q.shape[0], step):
        hi = min(lo + step, q.shape[0])
        ids = combine_indices(window_ids[lo:hi], range_indices(meta.vis_start[lo:hi], meta.vis_end[lo:hi], width),
                              kv.shape[0])
        o, lse = run(q[lo:hi], keys, ids)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


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

    ckv = selected = meta = None
    loss_inputs = None
    if layer.compressor is not None:
        meta = packed.compress(cfg.compress_ratio, x.device)
        ckv = _compress(layer.compressor, x, meta, layer.inv_freq, backend)
        if cfg.layer_type == "csa":
            indexer = layer.compressor.indexer
            keys = _compress(indexer, x.detach(), meta, layer.inv_freq, backend)
            q_idx = indexer.queries(qr.detach(), cos, sin)
            w = indexer.scorer(x.detach())
            selected = indexer_topk_static_op(q_idx, w, keys, meta.vis_start, meta.vis_end, cfg.index_topk,
                                              meta.max_visible, cfg.workspace_bytes, layer.backend_for(q_idx))
            loss_inputs = (q_idx, w, keys)

    if core:
        from ..layers.attention import CompressedRange, IndexerLossInputs

        compressed_ids = selected
        if cfg.layer_type == "hca":
            compressed_ids = CompressedRange(meta.vis_start, meta.vis_end, meta.max_visible)
        loss = None
        if loss_inputs is not None:
            loss = IndexerLossInputs(*loss_inputs, rows.real, rows.num_real, meta.vis_start, meta.vis_end)
        return layer.heads(qr, cos, sin, kv, ckv, window_ids, compressed_ids, loss, loss_scale=_loss_scale())

    o, lse = _attend(layer, q, kv, ckv, window_ids, selected, meta)
    layer.last_indexer_loss = None
    if loss_inputs is not None and layer.wants_indexer_loss():
        q_idx, w, keys = loss_inputs
        # the weight 1 / num_real_rows is divided on the device: the count is never read on the host
        row_weight = rows.real.to(lse.dtype) / rows.num_real.clamp(min=1)
        kl = indexer_kl_loss_op(
            q_idx, w, keys, q.detach(), ckv.detach(), lse.detach(), cfg.scale, row_weight,
            selected if cfg.indexer_loss_type == "sparse" else None, meta.vis_start, meta.vis_end,
            meta.max_visible, cfg.workspace_bytes, layer.backend_for(q_idx),
        )
        layer.last_indexer_loss = kl.detach()
        o = _attach_indexer_loss(o, kl * cfg.indexer_loss_coeff)
    return _output(layer, o, cos, sin)

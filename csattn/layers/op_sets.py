"""The two op sets a plan can name: the eager ops, or their ``torch.library`` custom ops (capture-safe path).

Both run the same implementations in eager mode. The custom ops have fake implementations, so
``torch.compile`` sees opaque nodes, and they take static bounds (the entry capacity, the widest visible
range) where the eager ops read a count on the host. The layer calls ops only through these methods where
the two differ; everything else (the block-recomputed core, RoPE, norms) is shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.backend import Backend
from ..ops.compressor.custom_ops import compress_pool_op
from ..ops.indexer import IndexerConfig, indexer_topk
from ..ops.indexer.custom_ops import indexer_topk_capture_safe_op
from ..ops.indexer_loss import IndexerLossConfig, indexer_kl_loss
from ..ops.indexer_loss.custom_ops import indexer_kl_loss_op
from ..ops.sparse_attn import SparseAttnConfig, sparse_attn
from ..ops.sparse_attn.custom_ops import sparse_attn_op
from .modules import Compressor, Projection, RowPieces, map_rows
from .projections import output_chunked, output_proj_op, query_heads_chunked, query_heads_op

__all__ = ["OpSet", "EagerOps", "CaptureSafeOps", "EAGER", "CAPTURE_SAFE"]


class EagerOps:
    """The ops called directly (the default path)."""

    def compress(self, comp: Compressor, x: Tensor | RowPieces, entries, inv_freq: Tensor, backend: Backend) -> Tensor:
        """``[Nc, dim]`` entries ``entries.meta`` lists, pooled from the ext rows ``x``."""
        return comp.compress(x, entries.meta, inv_freq, backend=backend)

    def indexer_topk(self, q_idx: Tensor, w: Tensor, keys: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int,
                     width: int, workspace_bytes: int, backend: Backend, config: IndexerConfig | None = None) -> Tensor:
        """``[T, topk]`` global ids (``width`` bounds the visible ranges; the eager op reads them itself)."""
        return indexer_topk(q_idx, w, keys, vis_start, vis_end, topk, workspace_bytes=workspace_bytes, backend=backend,
                            config=config)

    def sparse_attn(self, q: Tensor, keys: Tensor, ids: Tensor, sinks: Tensor, scale: float, chunk_rows: int,
                    backend: Backend, config: SparseAttnConfig | None = None) -> tuple[Tensor, Tensor]:
        return sparse_attn(q, keys, ids, sinks, scale, chunk_rows=chunk_rows, backend=backend, config=config)

    def indexer_kl_loss(self, loss, q: Tensor, ckv: Tensor, lse: Tensor, scale: float, selected: Tensor | None,
                        workspace_bytes: int, backend: Backend, config: IndexerLossConfig | None = None) -> Tensor:
        """The indexer KL loss of :class:`~csattn.layers.plan.IndexerLossInputs` ``loss`` (sparse over
        ``selected``, dense over the visible ranges when it is None)."""
        return indexer_kl_loss(loss.q_idx, loss.w, loss.k_idx, q, ckv, lse, scale, loss.row_weight(lse.dtype),
                               selected=selected, vis_start=loss.vis_start, vis_end=loss.vis_end,
                               workspace_bytes=workspace_bytes, backend=backend, config=config)

    def query_heads(self, qr: Tensor, cos: Tensor, sin: Tensor, q_b: Projection, heads: int, eps: float,
                    chunk_rows: int) -> Tensor:
        """``q [T, H, d]`` recomputed block by block in the backward."""
        return query_heads_chunked(qr, cos, sin, q_b, heads, eps, chunk_rows)

    def output(self, o: Tensor, cos: Tensor, sin: Tensor, o_a: Projection, o_b: Projection, groups: int,
               chunk_rows: int) -> Tensor:
        """The output projection of ``o [T, H, d]``, recomputed block by block in the backward."""
        return output_chunked(o, cos, sin, o_a, o_b, groups, chunk_rows)

    def unblocked(self, layer_type: str, loss_type: str, want_loss: bool) -> bool:
        """Whether the heads run unblocked (all queries at once) although projections are recomputed: the
        dense indexer loss needs every query."""
        return want_loss and loss_type == "dense"


class CaptureSafeOps(EagerOps):
    """The custom ops over static bounds: no host sync, no data-dependent shape (CUDA graphs, compile)."""

    def compress(self, comp: Compressor, x: Tensor | RowPieces, entries, inv_freq: Tensor, backend: Backend) -> Tensor:
        """``[capacity, dim]``: entry ``e`` pools from ext row ``meta.entry_row[e] - shift``. Slots not in
        ``entries.keep`` pool a zero scratch block appended after the rows, with no previous block, so they
        come out exactly zero and send no gradient to real rows (the fused backward stores, not adds, each
        row's gradient)."""
        meta, keep = entries.meta, entries.keep
        kv = F.pad(map_rows(comp.kv_proj, x), (0, 0, 0, comp.ratio))
        gate = F.pad(map_rows(comp.gate_proj, x), (0, 0, 0, comp.ratio))
        entry_row = torch.where(keep, meta.entry_row - entries.shift, entries.ext_rows)
        entry_first = meta.entry_first | ~keep
        pooled = compress_pool_op(kv, gate, comp.position_bias, entry_row, entry_first, comp.ratio, comp.overlap,
                                  backend)
        return comp.finish(pooled, meta.entry_pos, inv_freq)

    def indexer_topk(self, q_idx: Tensor, w: Tensor, keys: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int,
                     width: int, workspace_bytes: int, backend: Backend, config: IndexerConfig | None = None) -> Tensor:
        return indexer_topk_capture_safe_op(q_idx, w, keys, vis_start, vis_end, topk, width, workspace_bytes, backend,
                                      config.spec() if config else "")

    def sparse_attn(self, q: Tensor, keys: Tensor, ids: Tensor, sinks: Tensor, scale: float, chunk_rows: int,
                    backend: Backend, config: SparseAttnConfig | None = None) -> tuple[Tensor, Tensor]:
        # the custom op takes the settings as their parse string (custom ops take no dataclasses)
        return sparse_attn_op(q, keys, ids, sinks, scale, chunk_rows, backend, config.spec() if config else "")

    def indexer_kl_loss(self, loss, q: Tensor, ckv: Tensor, lse: Tensor, scale: float, selected: Tensor | None,
                        workspace_bytes: int, backend: Backend, config: IndexerLossConfig | None = None) -> Tensor:
        return indexer_kl_loss_op(loss.q_idx, loss.w, loss.k_idx, q.detach(), ckv.detach(), lse.detach(), scale,
                                  loss.row_weight(lse.dtype), selected, loss.vis_start, loss.vis_end, loss.width,
                                  workspace_bytes, backend, config.spec() if config else "")

    # the custom ops carry one weight a projection: a low-rank term comes in merged (Projection.merged)
    def query_heads(self, qr: Tensor, cos: Tensor, sin: Tensor, q_b: Projection, heads: int, eps: float,
                    chunk_rows: int) -> Tensor:
        return query_heads_op(qr, cos, sin, q_b.merged(), heads, eps, chunk_rows)

    def output(self, o: Tensor, cos: Tensor, sin: Tensor, o_a: Projection, o_b: Projection, groups: int,
               chunk_rows: int) -> Tensor:
        return output_proj_op(o, cos, sin, o_a.merged(), o_b.merged(), groups, chunk_rows)

    def unblocked(self, layer_type: str, loss_type: str, want_loss: bool) -> bool:
        """Also under ``torch.compile``: the block-recomputed core calls ``torch.autograd.grad``, which the compiler
        cannot trace, so there the phases go through the custom ops one by one."""
        return (layer_type == "csa" and loss_type == "dense") or torch.compiler.is_compiling()


OpSet = EagerOps  # the interface: an op set is an EagerOps or a subclass
EAGER = EagerOps()
CAPTURE_SAFE = CaptureSafeOps()

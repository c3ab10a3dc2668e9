"""``torch.library`` custom op for the indexer KL loss (sparse over the selected ids, or dense over every
visible entry through the capture-safe static window), with a fake implementation and a backward op."""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd import autograd_vjp
from . import indexer_kl_loss as _indexer_kl_loss
from .capture_safe import indexer_kl_loss_capture_safe_bwd_ref, indexer_kl_loss_dense_capture_safe
from .config import IndexerLossConfig

__all__ = ["indexer_kl_loss_op", "indexer_kl_loss_capture_safe"]


def indexer_kl_loss_capture_safe(
    q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor, width: int,
    workspace_bytes: int, backend: str, config: str = "",
) -> Tensor:
    """The loss without host syncs: the sparse loss and the fused dense loss as they are, the dense reference
    over the static candidate window of width ``width`` (``max_seqlen // r``). ``config``: the fused kernels'
    :meth:`IndexerLossConfig.parse` string ("" = the defaults)."""
    if selected is None and backend == "reference":
        return indexer_kl_loss_dense_capture_safe(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, vis_start, vis_end,
                                            width, workspace_bytes)
    return _indexer_kl_loss(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected=selected,
                            vis_start=vis_start, vis_end=vis_end, workspace_bytes=workspace_bytes, backend=backend,
                            config=IndexerLossConfig.parse(config) if config else None)


@torch.library.custom_op("csattn::indexer_kl_loss", mutates_args=())
def indexer_kl_loss_op(
    q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor, width: int,
    workspace_bytes: int, backend: str, config: str = "",
) -> Tensor:
    """Scalar loss: :func:`indexer_kl_loss_capture_safe` as one op (gradients to ``q_idx``, ``w``, ``k_idx``)."""
    with torch.no_grad():
        return indexer_kl_loss_capture_safe(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start,
                                      vis_end, width, workspace_bytes, backend, config).clone()


@indexer_kl_loss_op.register_fake
def _(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start, vis_end, width, workspace_bytes,
      backend, config=""):
    return q_idx.new_empty((), dtype=torch.promote_types(q_idx.dtype, torch.float32))


@torch.library.custom_op("csattn::indexer_kl_loss_bwd", mutates_args=())
def indexer_kl_loss_bwd_op(
    q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor, width: int,
    workspace_bytes: int, backend: str, grad: Tensor, config: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq_idx, dw, dk_idx)`` by recomputation (the reference one row chunk at a time, without
    ``torch.utils.checkpoint``, which CUDA graph capture does not allow)."""
    if backend == "reference":
        return indexer_kl_loss_capture_safe_bwd_ref(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected,
                                              vis_start, vis_end, width, workspace_bytes, grad)

    def fwd(q_idx_, w_, k_idx_):
        return indexer_kl_loss_capture_safe(q_idx_, w_, k_idx_, q, ckv, lse, scale, row_weight, selected, vis_start,
                                      vis_end, width, workspace_bytes, backend, config)

    dq_idx, dw, dk_idx = autograd_vjp(fwd, (q_idx, w, k_idx), (True, True, True), (grad,))
    return dq_idx, dw, dk_idx


@indexer_kl_loss_bwd_op.register_fake
def _(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start, vis_end, width, workspace_bytes,
      backend, grad, config=""):
    return torch.empty_like(q_idx), torch.empty_like(w), torch.empty_like(k_idx)


def _setup(ctx, inputs, output):
    ctx.tensors = len(inputs)
    q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start, vis_end, width, ws, backend, *rest = inputs
    config = rest[0] if rest else ""
    ctx.has_selected = selected is not None
    saved = (q_idx, w, k_idx, q, ckv, lse, row_weight, vis_start, vis_end)
    ctx.save_for_backward(*saved, *((selected,) if selected is not None else ()))
    ctx.args = (scale, width, ws, backend, config)


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    q_idx, w, k_idx, q, ckv, lse, row_weight, vis_start, vis_end = saved[:9]
    selected = saved[9] if ctx.has_selected else None
    scale, width, ws, backend, config = ctx.args
    dq_idx, dw, dk_idx = indexer_kl_loss_bwd_op(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected,
                                                vis_start, vis_end, width, ws, backend, grad, config)
    return (dq_idx, dw, dk_idx) + (None,) * (ctx.tensors - 3)


indexer_kl_loss_op.register_autograd(_backward, setup_context=_setup)

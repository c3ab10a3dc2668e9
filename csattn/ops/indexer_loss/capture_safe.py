"""Capture-safe dense indexer loss and the reference backward of the loss's custom op: row chunks of a static
height, candidates read over the static window of :func:`csattn.ops.indexer.capture_safe.static_window` (ids
``vis_start[t] + j``, ``j < width``, masked at or past ``vis_end[t]``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..autograd import autograd_vjp
from ..indexer.capture_safe import static_window
from ..indexer.chunks import fixed_row_chunks
from ..indexer.naive import indexer_scores_ref
from ..indices.naive import gather_rows_masked
from .naive import _sparse_chunk, _teacher_mass, kl_from_logits, sparse_loss_chunks

__all__ = ["indexer_kl_loss_dense_capture_safe", "indexer_kl_loss_capture_safe_bwd_ref"]


def _dense_window_chunks(q_idx: Tensor, q: Tensor, width: int, workspace_bytes: int) -> list[tuple[int, int]]:
    """Row chunks of the static dense loss: ``width`` candidates per row, each with ``[H + 2 HI]`` logits and a
    gathered ``d + cI`` row."""
    itemsize = torch.promote_types(q_idx.dtype, torch.float32).itemsize
    per_row = width * (q.shape[1] + 2 * q_idx.shape[1] + q.shape[2] + q_idx.shape[2]) * itemsize
    return fixed_row_chunks(q_idx.shape[0], per_row, workspace_bytes)


def _dense_window_chunk(q_idx, w, k_idx, q, ckv, lse, vis_start, vis_end, row_weight, scale, width):
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    ids, valid = static_window(vis_start, vis_end, width, k_idx.shape[0])
    # ids past a row's range name other documents' entries: gather zeros there (no 0 * NaN gradient to them)
    ids = torch.where(valid, ids, -1)
    student = indexer_scores_ref(q_idx, w, gather_rows_masked(k_idx, ids))
    mass = _teacher_mass(q.to(compute), gather_rows_masked(ckv, ids).to(compute), lse.to(compute), scale)
    return (kl_from_logits(student, mass, valid) * row_weight.to(compute)).sum()


def indexer_kl_loss_dense_capture_safe(
    q_idx: Tensor,
    w: Tensor,
    k_idx: Tensor,
    q: Tensor,
    ckv: Tensor,
    lse: Tensor,
    scale: float,
    row_weight: Tensor,
    vis_start: Tensor,
    vis_end: Tensor,
    width: int,
    workspace_bytes: int = 1 << 30,
) -> Tensor:
    """Dense indexer KL loss (every visible entry) without host syncs; contract of ``indexer_kl_loss_ref``
    with ``selected=None``, plus the static bound ``width`` on the visible ranges. Reference math only."""
    q, ckv, lse = q.detach(), ckv.detach(), lse.detach()
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    if k_idx.shape[0] == 0 or q_idx.shape[0] == 0 or width < 1:
        return (q_idx.sum() + w.sum() + k_idx.sum()).to(compute) * 0
    use_ckpt = torch.is_grad_enabled() and (q_idx.requires_grad or w.requires_grad or k_idx.requires_grad)
    total = q_idx.new_zeros((), dtype=compute)
    for lo, hi in _dense_window_chunks(q_idx, q, width, workspace_bytes):
        args = (q_idx[lo:hi], w[lo:hi], k_idx, q[lo:hi], ckv, lse[lo:hi], vis_start[lo:hi], vis_end[lo:hi],
                row_weight[lo:hi], scale, width)
        part = checkpoint(_dense_window_chunk, *args, use_reentrant=False) if use_ckpt else _dense_window_chunk(*args)
        total = total + part
    return total


def indexer_kl_loss_capture_safe_bwd_ref(
    q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor, width: int,
    workspace_bytes: int, grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq_idx, dw, dk_idx)`` of the reference loss (sparse: the ``indexer_kl_loss_ref`` chunks; dense: the
    static window chunks), recomputed and differentiated chunk by chunk; ``grad`` is the loss's gradient."""
    dq_idx, dw, dk_idx = torch.zeros_like(q_idx), torch.zeros_like(w), torch.zeros_like(k_idx)
    if k_idx.shape[0] == 0 or q_idx.shape[0] == 0 or (selected is None and width < 1):
        return dq_idx, dw, dk_idx
    q, ckv, lse = q.detach(), ckv.detach(), lse.detach()
    if selected is not None:  # the row chunks of indexer_kl_loss_ref's sparse loss
        chunks = sparse_loss_chunks(q_idx, q, selected, workspace_bytes)
    else:
        chunks = _dense_window_chunks(q_idx, q, width, workspace_bytes)
    for lo, hi in chunks:
        if selected is not None:
            def chunk(a, b, k, lo=lo, hi=hi):
                return _sparse_chunk(a, b, k, q[lo:hi], ckv, lse[lo:hi], selected[lo:hi], row_weight[lo:hi], scale)
        else:
            def chunk(a, b, k, lo=lo, hi=hi):
                return _dense_window_chunk(a, b, k, q[lo:hi], ckv, lse[lo:hi], vis_start[lo:hi], vis_end[lo:hi],
                                           row_weight[lo:hi], scale, width)
        g_q, g_w, g_k = autograd_vjp(chunk, (q_idx[lo:hi], w[lo:hi], k_idx), (True, True, True), (grad,))
        dq_idx[lo:hi] = g_q
        dw[lo:hi] = g_w
        dk_idx += g_k
    return dq_idx, dw, dk_idx

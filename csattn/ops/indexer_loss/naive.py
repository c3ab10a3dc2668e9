"""Reference indexer KL loss: sparse over the selected top-k, or dense over every visible entry; the sparse one
also from a teacher filled block by block (``teacher.py``)."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..indexer.chunks import fixed_row_chunks, row_chunks
from ..indexer.naive import indexer_scores_ref
from ..indices.naive import gather_rows_masked
from ..recompute import row_chunked
from .teacher import SparseTeacher, StudentQueries

__all__ = [
    "indexer_kl_loss_ref", "sparse_loss_chunks", "kl_from_logits", "sparse_teacher_block_ref",
    "indexer_kl_from_teacher_ref",
]


def kl_from_logits(student: Tensor, teacher_mass: Tensor, valid: Tensor) -> Tensor:
    """Per-row ``KL(T || softmax(student))`` over the valid candidates.

    Args:
        student: ``[R, K]`` indexer scores; teacher_mass: ``[R, K]`` non-negative head-summed attention
        probabilities (detached); valid: ``[R, K]`` bool.

    Returns:
        ``[R]``; rows without a valid candidate give 0.
    """
    has_any = valid.any(dim=1, keepdim=True)
    logits = student.masked_fill(~valid, float("-inf"))
    logits = torch.where(has_any, logits, torch.zeros_like(logits))
    log_p = torch.log_softmax(logits, dim=1)
    log_p = torch.where(valid, log_p, torch.zeros_like(log_p))
    mass = teacher_mass.masked_fill(~valid, 0.0)
    total = mass.sum(dim=1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    target = mass / total
    return (torch.xlogy(target, target) - target * log_p).sum(dim=1)


def _teacher_mass(q: Tensor, keys: Tensor, lse: Tensor, scale: float) -> Tensor:
    """``sum_h exp(scale * q_h . key - lse_h)``; ``keys`` is ``[K, d]`` (shared) or ``[R, K, d]``."""
    if keys.dim() == 2:
        logits = torch.einsum("rhd,kd->rhk", q, keys)
    else:
        logits = torch.einsum("rhd,rkd->rhk", q, keys)
    return torch.exp(logits * scale - lse[..., None]).sum(dim=1)


def _sparse_chunk(q_idx, w, k_idx, q, ckv, lse, selected, row_weight, scale):
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    valid = selected >= 0
    # empty slots gather zeros, never another document's entry 0 (whose gradient would get 0 * NaN)
    student = indexer_scores_ref(q_idx, w, gather_rows_masked(k_idx, selected))
    mass = _teacher_mass(q.to(compute), gather_rows_masked(ckv, selected).to(compute), lse.to(compute), scale)
    return (kl_from_logits(student, mass, valid) * row_weight.to(compute)).sum()


def _dense_chunk(q_idx, w, k_slab, q, ckv_slab, lse, ids, vis_start, vis_end, row_weight, scale):
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    valid = (ids[None, :] >= vis_start[:, None]) & (ids[None, :] < vis_end[:, None])
    student = indexer_scores_ref(q_idx, w, k_slab)
    mass = _teacher_mass(q.to(compute), ckv_slab.to(compute), lse.to(compute), scale)
    return (kl_from_logits(student, mass, valid) * row_weight.to(compute)).sum()


def sparse_loss_chunks(q_idx: Tensor, q: Tensor, selected: Tensor, workspace_bytes: int) -> list[tuple[int, int]]:
    """Row chunks of the sparse loss: ``[H + 2 HI]`` logits and a gathered ``d + cI`` row per candidate."""
    itemsize = torch.promote_types(q_idx.dtype, torch.float32).itemsize
    heads = q.shape[1] + 2 * q_idx.shape[1]
    per_row = selected.shape[1] * (heads + q.shape[2] + q_idx.shape[2]) * itemsize
    return fixed_row_chunks(q_idx.shape[0], per_row, workspace_bytes)


def indexer_kl_loss_ref(
    q_idx: Tensor,
    w: Tensor,
    k_idx: Tensor,
    q: Tensor,
    ckv: Tensor,
    lse: Tensor,
    scale: float,
    row_weight: Tensor,
    selected: Tensor | None = None,
    vis_start: Tensor | None = None,
    vis_end: Tensor | None = None,
    workspace_bytes: int = 1 << 30,
) -> Tensor:
    """Weighted sum over rows of ``KL(teacher || softmax(indexer scores))``.

    Student: indexer scores over the candidates (sparse: ``selected`` ids; dense: every id in
    ``[vis_start, vis_end)``). Teacher: per head ``exp(scale * q_h . ckv_i - lse_h)`` with ``lse`` the
    attention's full log-denominator (window + sink + attended compressed keys), summed over heads and
    L1-normalized over the candidates. Teacher inputs are detached, so only the indexer's inputs
    (``q_idx``, ``w``, ``k_idx``) receive gradients.

    Args:
        q_idx: ``[T, HI, cI]``; w: ``[T, HI]``; k_idx: ``[Nc, cI]`` indexer queries, weights and keys.
        q: ``[T, H, d]`` attention queries; ckv: ``[Nc, d]`` compressed kv; lse: ``[T, H]``.
        scale: attention softmax scale.
        row_weight: ``[T]`` weight of each row's KL (``1 / num_real_rows`` for real rows, 0 for padding).
        selected: ``[T, k]`` int64 selected ids (-1 = none) for the sparse loss, or None for dense.
        vis_start, vis_end: ``[T]`` visible id range per row (needed for the dense loss).
        workspace_bytes: bound on one chunk's workspace.

    Returns:
        A scalar (fp32, or fp64 for fp64 inputs).
    """
    q, ckv, lse = q.detach(), ckv.detach(), lse.detach()
    if k_idx.shape[0] == 0 or q_idx.shape[0] == 0:
        # No compressed entry: the loss is 0, still connected to every input so their grads exist.
        return (q_idx.sum() + w.sum() + k_idx.sum()).to(torch.promote_types(q_idx.dtype, torch.float32)) * 0
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    use_ckpt = torch.is_grad_enabled() and (q_idx.requires_grad or w.requires_grad or k_idx.requires_grad)
    run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if use_ckpt else (lambda f, *a: f(*a))
    heads = q.shape[1] + 2 * q_idx.shape[1]
    total = q_idx.new_zeros((), dtype=compute)
    if selected is not None:
        for lo, hi in sparse_loss_chunks(q_idx, q, selected, workspace_bytes):
            total = total + run(
                _sparse_chunk, q_idx[lo:hi], w[lo:hi], k_idx, q[lo:hi], ckv, lse[lo:hi],
                selected[lo:hi], row_weight[lo:hi], scale,
            )
        return total
    if vis_start is None or vis_end is None:
        raise ValueError("the dense indexer loss needs vis_start and vis_end")
    for lo, hi, key_lo, key_hi in row_chunks(vis_start, vis_end, heads * compute.itemsize, workspace_bytes):
        if key_hi <= key_lo:
            continue
        ids = torch.arange(key_lo, key_hi, device=q_idx.device)
        total = total + run(
            _dense_chunk, q_idx[lo:hi], w[lo:hi], k_idx[key_lo:key_hi], q[lo:hi], ckv[key_lo:key_hi],
            lse[lo:hi], ids, vis_start[lo:hi], vis_end[lo:hi], row_weight[lo:hi], scale,
        )
    return total


def sparse_teacher_block_ref(teacher: SparseTeacher, lo: int, q: Tensor, ckv: Tensor, lse: Tensor,
                             selected: Tensor, scale: float) -> None:
    """Fill ``teacher.mass[lo:lo+R]`` from a block's ``q [R, H, d]``, ``lse [R, H]`` and ``selected [R, k]``."""
    compute = teacher.mass.dtype
    valid = selected >= 0
    mass = _teacher_mass(q.to(compute), gather_rows_masked(ckv, selected).to(compute), lse.to(compute), scale)
    teacher.mass[lo:lo + q.shape[0]] = mass.masked_fill(~valid, 0.0)


def _student_rows(q_idx, w, mass, selected, row_weight, k_idx):
    """Per-row weighted KL of the student against fixed teacher masses, ``[R]``."""
    compute = torch.promote_types(q_idx.dtype, torch.float32)
    valid = selected >= 0
    student = indexer_scores_ref(q_idx, w, gather_rows_masked(k_idx, selected))
    return kl_from_logits(student, mass.to(compute), valid) * row_weight.to(compute)


def _student_rows_from_latent(query_fn, qr, cos, sin, w, mass, selected, row_weight, k_idx, *params):
    return _student_rows(query_fn(qr, cos, sin, *params), w, mass, selected, row_weight, k_idx)


def indexer_kl_from_teacher_ref(queries: StudentQueries, w: Tensor, k_idx: Tensor, teacher: SparseTeacher,
                                row_weight: Tensor, selected: Tensor, workspace_bytes: int = 1 << 30) -> Tensor:
    """The sparse loss of :func:`indexer_kl_loss_ref` from precomputed teacher masses (same value).

    Row chunks within ``workspace_bytes``; the queries and the student are recomputed chunk by chunk in the
    backward (``row_chunked``: no ``torch.utils.checkpoint``, so the capture-safe path can use it).
    """
    qr, cos, sin, params = queries.qr, queries.cos, queries.sin, queries.params
    weight = params[0]
    if k_idx.shape[0] == 0 or qr.shape[0] == 0:
        zero = qr.sum() + sum(p.sum() for p in params) + w.sum() + k_idx.sum()
        return zero.to(torch.promote_types(weight.dtype, torch.float32)) * 0
    heads = w.shape[1]
    per_row = (selected.shape[1] * (2 * heads + weight.shape[0] // heads + 1) + 3 * weight.shape[0]) \
        * teacher.mass.itemsize
    rows = fixed_row_chunks(qr.shape[0], per_row, workspace_bytes)[0][1]
    fn = partial(_student_rows_from_latent, queries.fn)
    return row_chunked(fn, (qr, cos, sin, w, teacher.mass, selected, row_weight), (k_idx, *params), rows).sum()

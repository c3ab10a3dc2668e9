"""Indexer KL loss (sparse / dense) and its gradient-injecting autograd function."""

from torch import Tensor

from ..backend import Backend, use_triton
from .attach import IndexerLossAutoScaler, attach_indexer_loss
from .config import IndexerLossConfig
from .naive import indexer_kl_from_teacher_ref, indexer_kl_loss_ref, kl_from_logits, sparse_teacher_block_ref
from .teacher import SparseTeacher, StudentQueries

__all__ = [
    "IndexerLossConfig", "IndexerLossAutoScaler", "SparseTeacher", "StudentQueries", "attach_indexer_loss",
    "indexer_kl_loss", "indexer_kl_loss_ref", "kl_from_logits", "sparse_teacher_block", "indexer_kl_from_teacher",
]


def indexer_kl_loss(q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
                    row_weight: Tensor, selected: Tensor | None = None, vis_start: Tensor | None = None,
                    vis_end: Tensor | None = None, workspace_bytes: int = 1 << 30, backend: Backend = "reference",
                    config: IndexerLossConfig | None = None) -> Tensor:
    """Dispatch point for the indexer KL loss (a scalar; gradients to ``q_idx``, ``w``, ``k_idx``).

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused per-row kernels (CUDA,
    or the CPU interpreter under ``TRITON_INTERPRET=1``). See :func:`indexer_kl_loss_ref` for the arguments.
    ``config`` sets the fused kernels' launch settings (:class:`IndexerLossConfig`, None: the defaults; the
    reference ignores it).
    """
    args = (q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start, vis_end, workspace_bytes)
    if use_triton(backend):
        from .triton import indexer_kl_loss_triton  # lazy: importing csattn must not need Triton

        return indexer_kl_loss_triton(*args, config=config)
    return indexer_kl_loss_ref(*args)


def sparse_teacher_block(teacher: SparseTeacher, lo: int, q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor,
                         ckv: Tensor, lse: Tensor, scale: float, row_weight: Tensor, selected: Tensor,
                         backend: Backend = "reference", config: IndexerLossConfig | None = None) -> None:
    """Fill rows ``lo .. lo + R`` of ``teacher`` from one block: ``q [R, H, d]`` and ``lse [R, H]`` of the
    attention, the block's ``selected [R, k]``, ``row_weight [R]`` and indexer ``q_idx [R, HI, cI]``, ``w [R, HI]``
    (the fused path computes the block's loss rows in the same pass). No autograd."""
    if ckv.shape[0] == 0:  # no compressed entry: the loss is 0 (``indexer_kl_from_teacher`` returns it)
        return
    if use_triton(backend):
        from .triton import sparse_teacher_block_triton

        sparse_teacher_block_triton(teacher, lo, q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected,
                                    config=config)
    else:
        sparse_teacher_block_ref(teacher, lo, q, ckv, lse, selected, scale)


def indexer_kl_from_teacher(queries: StudentQueries, w: Tensor, k_idx: Tensor, teacher: SparseTeacher,
                            row_weight: Tensor, selected: Tensor, workspace_bytes: int = 1 << 30,
                            backend: Backend = "reference", config: IndexerLossConfig | None = None) -> Tensor:
    """The sparse indexer KL loss (a scalar; gradients to the query weight, ``w`` and ``k_idx``) from a filled
    teacher.

    Equals :func:`indexer_kl_loss` with ``selected`` and ``q_idx = queries.fn(qr, cos, sin, weight)``. The
    teacher was taken
    block by block from the attention forward, so the attention queries ``q [T, H, d]`` never exist for all rows
    at once; the backward recomputes the indexer queries block by block from ``queries``, so neither does
    ``q_idx [T, HI, cI]`` after the forward.
    """
    if use_triton(backend):
        from .triton import indexer_kl_from_teacher_triton

        return indexer_kl_from_teacher_triton(queries, w, k_idx, teacher, row_weight, selected, config=config)
    return indexer_kl_from_teacher_ref(queries, w, k_idx, teacher, row_weight, selected, workspace_bytes)

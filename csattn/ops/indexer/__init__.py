"""Lightning indexer scores and causal top-k selection."""

from torch import Tensor

from ..backend import Backend, use_triton
from .chunks import row_chunks
from .config import IndexerConfig
from .naive import indexer_scores_ref, indexer_topk_ref

__all__ = ["IndexerConfig", "indexer_scores_ref", "indexer_topk_ref", "indexer_topk", "row_chunks"]


def indexer_topk(q: Tensor, w: Tensor, k: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int,
                 workspace_bytes: int = 1 << 30, backend: Backend = "reference",
                 config: IndexerConfig | None = None) -> Tensor:
    """Dispatch point for the indexer top-k: ``[T, topk]`` int64 ids, ascending, ties to the lower id, -1 pad.

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused score + exact selection
    kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``). Both return the same ids; see
    :func:`indexer_topk_ref` for the arguments. ``config`` sets the fused kernels' launch settings
    (:class:`IndexerConfig`, None: the defaults; the reference ignores it).
    """
    if use_triton(backend):
        from .triton import indexer_topk_triton  # lazy: importing csattn must not need Triton

        return indexer_topk_triton(q, w, k, vis_start, vis_end, topk, workspace_bytes, config=config)
    return indexer_topk_ref(q, w, k, vis_start, vis_end, topk, workspace_bytes)

"""Lightning indexer scores and causal top-k selection."""

from .config import IndexerConfig
from .naive import indexer_scores_ref, indexer_topk_ref, row_chunks

__all__ = ["IndexerConfig", "indexer_scores_ref", "indexer_topk_ref", "indexer_topk", "row_chunks"]


def indexer_topk(*args, backend: str = "reference", config: IndexerConfig | None = None, **kwargs):
    """Dispatch point for the indexer top-k: ``[T, topk]`` int64 ids, best first, ties to the lower id, -1 pad.

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused score + exact selection
    kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``). Both return the same ids; see
    :func:`indexer_topk_ref` for the arguments. ``config`` sets the fused kernels' launch settings
    (:class:`IndexerConfig`, None: the defaults; the reference ignores it).
    """
    if backend == "triton":
        from .triton import indexer_topk_triton  # lazy: importing csattn must not need Triton

        return indexer_topk_triton(*args, config=config, **kwargs)
    if backend != "reference":
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return indexer_topk_ref(*args, **kwargs)

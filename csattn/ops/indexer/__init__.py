"""Lightning indexer scores and causal top-k selection."""

from .naive import indexer_scores_ref, indexer_topk_ref, row_chunks

__all__ = ["indexer_scores_ref", "indexer_topk_ref", "indexer_topk", "row_chunks"]


def indexer_topk(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the indexer top-k: ``[T, topk]`` int64 ids, best first, ties to the lower id, -1 pad.

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused score + exact selection
    kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``). Both return the same ids; see
    :func:`indexer_topk_ref` for the arguments.
    """
    if backend == "triton":
        from .triton import indexer_topk_triton  # lazy: importing csattn must not need Triton

        return indexer_topk_triton(*args, **kwargs)
    if backend != "reference":
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return indexer_topk_ref(*args, **kwargs)

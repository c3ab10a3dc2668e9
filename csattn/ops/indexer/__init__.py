"""Lightning indexer scores and causal top-k selection."""

from .naive import indexer_scores_ref, indexer_topk_ref, row_chunks

__all__ = ["indexer_scores_ref", "indexer_topk_ref", "indexer_topk", "row_chunks"]


def indexer_topk(*args, **kwargs):
    """Dispatch point for the indexer top-k (reference implementation on every device)."""
    return indexer_topk_ref(*args, **kwargs)

"""Lightning indexer scores and causal top-k selection."""

from .naive import indexer_scores_ref, indexer_topk_ref, row_chunks

__all__ = ["indexer_scores_ref", "indexer_topk_ref", "indexer_topk", "row_chunks"]


def indexer_topk(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the indexer top-k .

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused kernels (once they exist)."""
    return indexer_topk_ref(*args, **kwargs)

"""Indexer KL loss (sparse / dense) and its gradient-injecting autograd function."""

from .naive import IndexerLossAutoScaler, attach_indexer_loss, indexer_kl_loss_ref, kl_from_logits

__all__ = ["IndexerLossAutoScaler", "attach_indexer_loss", "indexer_kl_loss", "indexer_kl_loss_ref", "kl_from_logits"]


def indexer_kl_loss(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the indexer KL loss .

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused kernels (once they exist)."""
    return indexer_kl_loss_ref(*args, **kwargs)

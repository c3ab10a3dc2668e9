"""Indexer KL loss (sparse / dense) and its gradient-injecting autograd function."""

from .naive import IndexerLossAutoScaler, attach_indexer_loss, indexer_kl_loss_ref, kl_from_logits

__all__ = ["IndexerLossAutoScaler", "attach_indexer_loss", "indexer_kl_loss", "indexer_kl_loss_ref", "kl_from_logits"]


def indexer_kl_loss(*args, **kwargs):
    """Dispatch point for the indexer KL loss (reference implementation on every device)."""
    return indexer_kl_loss_ref(*args, **kwargs)

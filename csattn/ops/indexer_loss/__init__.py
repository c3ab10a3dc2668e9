"""Indexer KL loss (sparse / dense) and its gradient-injecting autograd function."""

from .naive import IndexerLossAutoScaler, attach_indexer_loss, indexer_kl_loss_ref, kl_from_logits

__all__ = ["IndexerLossAutoScaler", "attach_indexer_loss", "indexer_kl_loss", "indexer_kl_loss_ref", "kl_from_logits"]


def indexer_kl_loss(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the indexer KL loss (a scalar; gradients to ``q_idx``, ``w``, ``k_idx``).

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused per-row kernels (CUDA,
    or the CPU interpreter under ``TRITON_INTERPRET=1``). See :func:`indexer_kl_loss_ref` for the arguments.
    """
    if backend == "triton":
        from .triton import indexer_kl_loss_triton  # lazy: importing csattn must not need Triton

        return indexer_kl_loss_triton(*args, **kwargs)
    if backend != "reference":
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return indexer_kl_loss_ref(*args, **kwargs)

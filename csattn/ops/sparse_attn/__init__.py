"""Sparse attention with a per-head sink over per-row key index lists."""

from .naive import sparse_attn_chunk, sparse_attn_ref

__all__ = ["sparse_attn", "sparse_attn_chunk", "sparse_attn_ref"]


def sparse_attn(*args, backend: str = "reference", **kwargs):
    """Dispatch point for sparse attention .

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused kernels (once they exist)."""
    return sparse_attn_ref(*args, **kwargs)

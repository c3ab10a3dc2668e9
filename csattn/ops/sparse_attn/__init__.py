"""Sparse attention with a per-head sink over per-row key index lists."""

from .naive import sparse_attn_chunk, sparse_attn_ref

__all__ = ["sparse_attn", "sparse_attn_chunk", "sparse_attn_ref"]


def sparse_attn(*args, **kwargs):
    """Dispatch point for sparse attention (reference implementation on every device)."""
    return sparse_attn_ref(*args, **kwargs)

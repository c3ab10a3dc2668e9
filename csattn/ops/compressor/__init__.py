"""Compressor: gated per-channel softmax pooling of token blocks into compressed KV entries."""

from .naive import compress_pool_ref

__all__ = ["compress_pool_ref", "compress_pool"]


def compress_pool(*args, **kwargs):
    """Dispatch point for the compressor pooling (reference implementation on every device)."""
    return compress_pool_ref(*args, **kwargs)

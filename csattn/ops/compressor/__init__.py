"""Compressor: gated per-channel softmax pooling of token blocks into compressed KV entries."""

from .naive import compress_pool_ref

__all__ = ["compress_pool_ref", "compress_pool"]


def compress_pool(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the compressor pooling .

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused kernels (once they exist)."""
    return compress_pool_ref(*args, **kwargs)

"""Layers built from the ops."""

from .attention import HybridAttention

__all__ = ["HybridAttention"]

"""Compressor: gated per-channel softmax pooling of token blocks into compressed KV entries."""

from .naive import compress_pool_ref

__all__ = ["compress_pool_ref", "compress_pool"]


def compress_pool(*args, backend: str = "reference", **kwargs):
    """Dispatch point for the compressor pooling: ``[Nc, c]`` entries (gradients to kv, gate, position bias).

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused forward/backward kernels
    (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``). See :func:`compress_pool_ref` for arguments.
    """
    if backend == "triton":
        from .triton import compress_pool_triton  # lazy: importing csattn must not need Triton

        return compress_pool_triton(*args, **kwargs)
    if backend != "reference":
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return compress_pool_ref(*args, **kwargs)

"""Compressor: gated per-channel softmax pooling of token blocks into compressed KV entries."""

from torch import Tensor

from ..backend import Backend, use_triton
from .naive import compress_pool_ref

__all__ = ["compress_pool_ref", "compress_pool"]


def compress_pool(kv: Tensor, gate: Tensor, position_bias: Tensor, entry_row: Tensor, entry_first: Tensor, ratio: int,
                  overlap: bool, backend: Backend = "reference") -> Tensor:
    """Dispatch point for the compressor pooling: ``[Nc, c]`` entries (gradients to kv, gate, position bias).

    ``backend="reference"`` runs the plain-PyTorch reference; ``"triton"`` the fused forward/backward kernels
    (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``). See :func:`compress_pool_ref` for the arguments.
    """
    if use_triton(backend):
        from .triton import compress_pool_triton  # lazy: importing csattn must not need Triton

        return compress_pool_triton(kv, gate, position_bias, entry_row, entry_first, ratio, overlap)
    return compress_pool_ref(kv, gate, position_bias, entry_row, entry_first, ratio, overlap)

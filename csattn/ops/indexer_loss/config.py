"""``IndexerLossConfig``: launch settings of the fused indexer KL loss kernels."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["IndexerLossConfig"]


@dataclass(frozen=True)
class IndexerLossConfig(KernelConfig):
    """Candidates per tile and warps of the forward / backward programs.

    Measured on the H200 at 32k tokens, k=512: forward 8.7 ms with 32 x 4 warps (12.5 ms with 64 x 8),
    backward 7.5 ms with 64 x 8 warps (10.7 ms with 32 x 8). The benchmark's variants
    (``IndexerLossConfig.parse("bk_fwd=64,warps_fwd=8")``) override these.
    """

    bk_fwd: int = 32
    bk_bwd: int = 64
    warps_fwd: int = 4
    warps_bwd: int = 8

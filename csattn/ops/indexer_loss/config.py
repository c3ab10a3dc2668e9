"""``IndexerLossConfig``: launch settings of the fused indexer KL loss kernels."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["IndexerLossConfig"]


@dataclass(frozen=True)
class IndexerLossConfig(KernelConfig):
    """Candidates per tile and warps of the forward / backward programs.

    Defaults are the fastest measured on an H200 at k = 512 (BENCHMARKS.md): the forward keeps one row's
    candidates in small tiles on 4 warps (its per-row softmax state is the cost), the backward's key-gradient
    products want larger tiles on 8. ``IndexerLossConfig.parse("bk_fwd=64,warps_fwd=8")`` is how a variant is
    written.
    """

    bk_fwd: int = 32
    bk_bwd: int = 64
    warps_fwd: int = 4
    warps_bwd: int = 8
    # True: the backward sums the key gradient in exact int64 fixed point (csattn/ops/fixed_point.py), the same bits
    # run to run; False: fp32 atomics. Set by the caller (a layer: from AttentionConfig.deterministic)
    deterministic: bool = False

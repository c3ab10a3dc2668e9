"""``SparseAttnConfig``: launch settings of the fused sparse-attention kernels (no Triton import here, so
``csattn.config.AttentionConfig`` can carry one)."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["SparseAttnConfig"]


@dataclass(frozen=True)
class SparseAttnConfig(KernelConfig):
    """Launch parameters: head block ``bh`` (None: all heads up to 64); key block, warps and pipeline stages per
    Triton kernel (forward, dq, dkv); which kernels run Gluon; the Gluon forward's register split.

    Defaults are the fastest measured on an H200 at H = 64, d = 512, k + W = 640 (BENCHMARKS.md). d = 512 tiles
    fill most of the 227 KB of shared memory, so larger key blocks or more stages can fail to launch. The autograd
    function keeps the forward's config for its backward. ``SparseAttnConfig.parse("bk_fwd=32,fwd_gluon=0")`` is
    how a variant is written.
    """

    bh: int | None = None
    bk_fwd: int = 64
    warps_fwd: int = 8
    stages_fwd: int = 2
    bk_dq: int = 64
    warps_dq: int = 8
    stages_dq: int = 1
    bk_dkv: int = 64
    warps_dkv: int = 8
    stages_dkv: int = 1
    # 1: the forward / the backward run the Gluon kernels (gluon_fwd.py, gluon_bwd.py) where they apply (sm_90,
    # bf16/fp16, 64-head blocks, d in 128..512 a power of two); 0: the Triton kernels (the portable path).
    fwd_gluon: int = 1
    bwd_gluon: int = 1
    # Registers (per thread) of the Gluon forward's odd side and of its producer warpgroup; the even side gets the
    # rest of the 512 a thread slot has (224 with these): the split at which no partition spills.
    fwd_side_regs: int = 216
    fwd_producer_regs: int = 64
    # True: the backward sums dkv in exact int64 fixed point (csattn/ops/fixed_point.py), the same bits run to run
    # (the Gluon backward's fixed-point variant where the Gluon backward applies, else the Triton pair); False: fp32
    # atomics (faster). Set by the caller (a layer: from AttentionConfig.deterministic); the kernels read only this
    deterministic: bool = False


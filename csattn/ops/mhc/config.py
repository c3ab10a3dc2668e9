"""``MhcConfig``: launch settings of the fused mHC kernels (no Triton import here, so a caller can hold one
without Triton)."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["MhcConfig"]


@dataclass(frozen=True)
class MhcConfig(KernelConfig):
    """Tile sizes (rows, flat channels ``n*D``, channels ``D``), warps and options of the mHC kernels, handed to
    :func:`~csattn.ops.mhc.hc_site` / ``hc_pre`` / ``hc_head`` / ``hc_combine`` as ``config=`` (None: these
    defaults). ``MhcConfig.parse("fwd_rows=32,bwd_k=32")`` is how a benchmark variant is written.

    The defaults are chosen so that no kernel spills registers on sm_90 (ptxas -v) at n = 4: the forward's
    collapse loads n row tiles of ``fwd_d`` channels at once, and the fp32 FMA dot (streams not bf16) takes the
    narrower ``fwd_k_fma``. ``fwd_rows_small`` replaces ``fwd_rows`` where ``fwd_rows`` would leave SMs idle (a
    few thousand rows).

    ``*_split=1``: bf16 streams meet the fp32 weights on the tensor cores, the fp32 operand in three bf16 parts
    (hi + mid + lo, exact to 24 bits; the products are exact). The tensor cores' fp32 accumulation is not IEEE, so
    the forward sums only one k tile (3 * fwd_k products) there and adds the tiles' partial sums in IEEE fp32: the
    logits then stay as close to fp32 as the FMA dot's, several times faster (README). The backward's g @ fn (K-dim
    M: no long accumulation) is split the same way (``bwd_split=1``); its other product, the fn gradient g^T @ X,
    is one cuBLAS GEMM over the rows, so the stream kernel is a plain row x channel tiling that reads and writes
    each stream element once.

    ``scratch_rows``: rows per launch of the backward's first kernel, which bounds its Sinkhorn scratch
    (``scratch_rows * (2 * iters - 1) * n^2`` floats).
    """

    fwd_rows: int = 64
    fwd_rows_small: int = 32
    fwd_k: int = 64
    fwd_k_fma: int = 32
    fwd_d: int = 32
    fwd_warps: int = 8
    coef_rows: int = 16
    coef_d: int = 256
    coef_warps: int = 4
    bwd_rows: int = 64
    bwd_k: int = 64
    bwd_warps: int = 4
    comb_rows: int = 4
    comb_d: int = 256
    comb_warps: int = 4
    collapse_rows: int = 16
    collapse_d: int = 256
    collapse_warps: int = 4
    fwd_split: int = 1
    bwd_split: int = 1
    scratch_rows: int = 16384

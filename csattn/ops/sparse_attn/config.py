"""``SparseAttnConfig``: launch settings of the fused sparse-attention kernels (no Triton import here, so
``csattn.config.AttentionConfig`` can carry one)."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["SparseAttnConfig"]


@dataclass(frozen=True)
class SparseAttnConfig(KernelConfig):
    """Launch parameters: head block ``bh`` (None: all heads up to 64); key block, warps and pipeline stages per
    kernel (forward, dq, dkv); which kernels run Gluon.

    Defaults were tuned on an H200 at H=64, d=512, k+W=640 (BENCHMARKS.md); d=512 tiles fill most of
    the 227 KB of shared memory, so larger key blocks or more stages can fail to launch. The autograd function
    keeps the forward's config for its backward. ``SparseAttnConfig.parse("bk_fwd=32,fwd_gluon=0")`` is how the
    benchmark's variants are written.
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
    # 1: the forward / the backward run the Gluon kernels (gluon_fwd.py, gluon_bwd.py) where they apply
    # (sm_90, bf16/fp16, 64-head blocks, d in 128..512 a power of two); 0: the Triton kernels.
    fwd_gluon: int = 1
    bwd_gluon: int = 1
    # Gluon forward: n programs per SM, each looping over (row, 64-head block) items, the next item's q and first
    # pair of key tiles loaded while this item's last pair is computed; 0: one program per item. Measured (H200,
    # d = 512, 640 keys a row, 8k / 32k): 1: 1.19 / 5.34 ms, 0: 1.41 / 5.70 (a second program an SM does not fit
    # next to the first's 209 KB of shared memory).
    fwd_persistent: int = 1
    # Registers (per thread) of the Gluon forward's odd side and of its producer warpgroup; the even side gets the
    # rest of the 512 a thread slot has (224 with these). Both sides and the producer compile without spills here
    # (Triton 3.6 and 3.9); the producer spills at 56 (8 / 16 bytes), the odd side at 208 with Triton 3.9 (68).
    fwd_side_regs: int = 216
    fwd_producer_regs: int = 64
    # Gluon backward: n programs per SM, each looping over (row, 64-head block) items, the next item's first
    # gather and row terms under the previous item's last key-side chunks; 0: one program per item. Measured
    # (H200, d = 512, 8k / 32k): 1: 4.49 / 18.36 ms, 0: 4.58 / 18.85, 2: 4.42 / 20.72 (two waves).
    bwd_persistent: int = 1
    # Gluon backward: 1: the dkv reductions cover whole L2 lines (4 rows x 128 bytes a warp instruction), one
    # lane / register trade away from the MMA layout; 0: 8 rows x 64 bytes straight from the MMA registers.
    # Measured (H200, d = 512, 640 keys a row, 32k / 8k): 1: 17.40 / 4.13 ms, 0: 18.08 / 4.34.
    bwd_full_lines: int = 1
    # Gluon forward and backward: 1: a row ends at its last tile holding an id >= 0 (read from the index list at
    # the row's start), so the tiles of -1 after it are not run: rows whose selection is not full (a document's
    # first k * ratio rows), padding rows, HCA's ranges. 0: every row runs cdiv(K, 64) tiles.
    skip_empty_tiles: int = 1
    # 1: print registers, spills and shared memory of each launched kernel, once per config (tuning runs)
    verbose: int = 0

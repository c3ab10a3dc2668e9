"""``IndexerConfig``: launch settings of the fused indexer score and top-k selection kernels."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["IndexerConfig"]


@dataclass(frozen=True)
class IndexerConfig(KernelConfig):
    """Score-kernel tiles (rows ``bt`` x keys ``bk`` per program, ``warps``, pipeline ``stages``, ``tma`` query
    loads) and the selection's compaction tile (``seg``), warps for rows searched in registers (``select_warps``),
    the longest visible range searched in registers (``register_row``; longer rows stream their workspace row every
    step) and the bracket size at which the search parks its candidates (``cand``).

    Defaults are the fastest measured on an H200 at HI = 64, cI = 128, k = 512 (BENCHMARKS.md). Why each:

    - ``bt=64, bk=128, warps=4, stages=2``: three programs an SM, so one's tensor-core products overlap another's
      ReLU sums (one 8-warp program of 128 x 128 runs them in lockstep).
    - ``seg=512, select_warps=4``: the compaction's tile and the search's warps past which more only adds sync.
    - ``register_row=32768``: a 128k document's longest rows (32k keys, 128 registers a thread on 8 warps) still
      search in registers, where streaming the row every step is twice as slow.
    - ``cand=256``: small enough to stay in registers, large enough that few rows count the whole row twice.
    - ``tma=1``: TMA query blocks (bf16 / fp16, power-of-two cI, Hopper or later; pointer loads otherwise).

    ``IndexerConfig.parse("bt=128,warps=8")`` is how a variant is written.
    """

    bt: int = 64
    bk: int = 128
    warps: int = 4
    stages: int = 2
    seg: int = 512
    select_warps: int = 4
    register_row: int = 32768
    # the in-register search counts over the whole row until its bracket holds at most `cand` keys, then over
    # those alone (capped at (topk + 1) // 2: they and the ids of every key at or above the bracket, fewer than
    # topk + cand, are gathered into the row's 2 * topk int32 output slots)
    cand: int = 256
    # 1: the score kernel reads its query blocks through a TMA descriptor (bf16 / fp16, power-of-two cI, Hopper
    # or later; the pointer loads otherwise)
    tma: int = 1

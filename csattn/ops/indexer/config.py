"""``IndexerConfig``: launch settings of the fused indexer score and top-k selection kernels."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel_config import KernelConfig

__all__ = ["IndexerConfig"]


@dataclass(frozen=True)
class IndexerConfig(KernelConfig):
    """Score-kernel tiles (rows ``bt`` x keys ``bk`` per program, ``warps``, pipeline ``stages``) and the
    selection's compaction tile (``seg``), warps for rows searched in registers (``select_warps``) and the longest
    visible range searched in registers (``register_row``; longer rows stream their workspace row every step).

    Measured on the H200 at 32k tokens (HI = 64, cI = 128, k = 512; benchmarks/results/indexer_topk_*_h200_1a050af /
    0590684 / e862708.json, Triton 3.6): 64 x 128 score tiles on 4 warps, 2 stages 3.31-3.41 ms against 3.79-3.96
    for 128 x 128 on 8 warps, 3 stages (three programs an SM: one's tensor-core products overlap another's ReLU
    sums, where one 8-warp program per SM runs them in lockstep); 3 stages 3.63-3.70, 64 x 64 4.39, 64 x 256 on 8
    warps 5.36; TMA query blocks 3.20-3.23; a 168-register cap 3.29 (no change). Selection: 512-key tiles 1.42-1.56
    ms, 1024 1.38-1.96, 256 1.53-1.66; 8 warps 1.84-1.86; ``cand`` 256 1.50 against 1024 1.56. ``register_row``: a
    row of 4096 keys a warp is 128 registers a thread; at 128k (rows of 32k keys) 32768 measured 32.2 ms for the
    selection against 75.3 with 16384 (streamed), 36.2 on 16 warps instead of 8. The benchmark's variants
    (``IndexerConfig.parse("bt=128,warps=8")``) override these.
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
    # tma=1: the score kernel reads its query blocks through a TMA descriptor (bf16 / fp16, power-of-two cI,
    # Hopper or later; the pointer loads otherwise)
    tma: int = 1
    # radix=1: rows searched in registers find their threshold by three radix-histogram passes (11 + 11 + 10 bits)
    # instead of the bisection's up to 32 block-wide counts (the same threshold and count, so the same selection;
    # timed on the H200 at f0c4080: 3.3x (8k) / 4.9x (32k) slower than the bisection, tl.histogram's per-key
    # shared-memory atomics; kept opt-in, its exactness tests run on the CPU and the GPU)
    radix: int = 0

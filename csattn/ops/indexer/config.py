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

    Measured on the H200: 128 x 128 score tiles 3.78 ms vs 4.18 for 64 x 128 at 32k tokens (HI = 64, cI = 128).
    Selection (benchmarks/results/indexer_topk_h200_2ab5ea5.json and _7a4fd54.json): at 32k, 4 warps and
    1024-key tiles 1.96 ms, 8 warps 2.20, 2048-key tiles 2.62 (each with the sort inside the selection program, now
    a kernel of its own); at 64k (rows of 16k keys) 4 warps 6.68 ms, 8 warps 6.89, 16 warps 7.71. A three-way
    search (two thresholds a step) measured slower (2.31 ms against 2.20 on 8 warps). ``register_row``: a row of
    4096 keys a warp is 128 registers a thread; at 128k (rows of 32k keys) 32768 measured 32.2 ms for the selection
    against 75.3 with 16384 (streamed), 36.2 on 16 warps instead of 8. The benchmark's variants
    (``IndexerConfig.parse("bt=64,warps=4")``) override these.
    """

    bt: int = 64
    bk: int = 128
    warps: int = 4
    stages: int = 2
    seg: int = 512
    select_warps: int = 4
    register_row: int = 32768
    # the in-register search counts over the whole row until its bracket holds at most `cand` keys, then over
    # those alone (capped at 2 * topk: they are parked in the row's output slots)
    cand: int = 1024
    # a register cap for the score kernel (0: the compiler's choice), so that more programs share an SM
    maxnreg: int = 0
    # tma=1: the score kernel reads its query blocks through a TMA descriptor (bf16 / fp16, power-of-two cI)
    tma: int = 0
    # radix=1: rows searched in registers find their threshold by three radix-histogram passes (11 + 11 + 10 bits)
    # instead of the bisection's up to 32 block-wide counts (the same threshold and count, so the same selection;
    # timed on the H200 at f0c4080: 3.3x (8k) / 4.9x (32k) slower than the bisection, tl.histogram's per-key
    # shared-memory atomics; kept opt-in, its exactness tests run on the CPU and the GPU)
    radix: int = 0

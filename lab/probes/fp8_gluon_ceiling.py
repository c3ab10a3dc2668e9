"""How fast the Gluon FP8 kernel's pipeline could run the forward without its per-step promotion: the library's
producer (TMA ring, persistent grid, group lookup) with a math partition that does less than the kernel's.

- ``MODE 0``: one accumulator chained through the contraction (``use_acc``), one product left running: a plain
  FP8 GEMM with no block scales. The ceiling of this tile shape and pipeline.
- ``MODE 1``: the kernel's overlapped loop (a fresh product a step, promoted while the next runs), the activation's
  scales read once a tile instead of once a step: what the promotion's arithmetic costs without its loads.

Why: on an H100 at 9f38fc4 the kernel's forward ran 764 / 787 TFLOP/s on one dense group where cuBLAS's blockwise
``_scaled_mm`` ran 1178 / 1182; per 128-deep step 0.68 us against 0.47. If ``MODE 0`` runs near cuBLAS, the
promotion is what costs; if not, the tile shape and pipeline are. The outputs are wrong by design (no scales):
only their time is read. Found (H100, d5940f4, lab/results/finetune_h100/ceiling_d5940f4.txt): the stores were the
pipeline's loss (``EPI``, the result through shared memory: ``MODE 0`` 1040-1074 TFLOP/s on the dense shapes, cuBLAS's
rate; the kernel took it as ``COALESCED``); at the MoE's shapes what is left is the groups' empty rows
(lab.probes.fp8_gluon_wide). Run on a GPU of sm_90: python -m lab.probes.fp8_gluon_ceiling"""

from __future__ import annotations

from functools import partial

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from csattn.ops.fp8.gluon import _LOWER, _UPPER, _issue, _producer, _promote, _store, launch_settings, tile_descs
from csattn.ops.fp8.gluon_tiles import BK, BM, BN, _tile, acc_layout, tile_walk
from lab.probes.gluon_forms import bench, forward_cases, forward_ring


@gluon.jit
def _chain(a_smem, raw, land, empty, it, nk, HALF: gl.constexpr, STAGES: gl.constexpr):
    """``MODE 0``: the tile's steps into one accumulator, one product left running while the next is issued, in
    rounds of four steps (as the kernel: no product in flight across the loop's back edge, where ptxas would
    serialize the MMAs)."""
    acc = gl.zeros([64, BN], gl.float32, layout=acc_layout())
    for r in range(nk // 4):
        for i in gl.static_range(4):
            j = it + 4 * r + i
            s = j % STAGES
            mbarrier.wait(land.index(s), (j // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(s).slice(HALF * 64, 64, dim=0), raw.index(s).permute((1, 0)), acc,
                                is_async=True)
            if i > 0:
                acc = warpgroup_mma_wait(1, deps=[acc])
                mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((it + 4 * r + 3) % STAGES), count=1)
    return acc


@gluon.jit
def _math_ceiling(sa, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_om, smem, HALF: gl.constexpr,
                  E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                  EPI: gl.constexpr):
    ACC: gl.constexpr = acc_layout()
    a_smem, raw, bt, land, ready, empty = smem
    zero = gl.zeros([64, BN], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        rows = row0 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        rmask = rows < row_end
        if g < E:
            if MODE == 0:
                acc = _chain(a_smem, raw, land, empty, it, nk, HALF, STAGES)
            else:
                sc = gl.load(sa + rows.to(gl.int64) * stride_sam, mask=rmask, other=0.0)
                acc = zero
                for r in range(nk // 4):
                    j = it + 4 * r
                    t0 = _issue(a_smem, raw, land, zero, j, HALF, STAGES)
                    t1 = _issue(a_smem, raw, land, zero, j + 1, HALF, STAGES)
                    acc = _promote(acc, t0, sc, empty, j, 1, STAGES)
                    t2 = _issue(a_smem, raw, land, zero, j + 2, HALF, STAGES)
                    acc = _promote(acc, t1, sc, empty, j + 1, 1, STAGES)
                    t3 = _issue(a_smem, raw, land, zero, j + 3, HALF, STAGES)
                    acc = _promote(acc, t2, sc, empty, j + 2, 1, STAGES)
                    acc = _promote(acc, t3, sc, empty, j + 3, 0, STAGES)
            it += nk
            _store(out, acc, row0 + HALF * 64, row_end, pid_n, stride_om, EPI)
        elif g == E:
            _store(out, zero, row0 + HALF * 64, row_end, pid_n, stride_om, EPI)


@gluon.jit
def ceiling_kernel(a_desc, w_desc, sa, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam, stride_om,
                   E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                   EPI: gl.constexpr, MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """The forward's pipeline (:func:`csattn.ops.fp8.gluon.fp8_grouped_gluon_kernel` with ``TRANS`` off, no
    low-rank term) with :func:`_math_ceiling` as its math warpgroups."""
    a_smem, raw, land, empty = forward_ring(STAGES, BM, BN)
    smem = (a_smem, raw, raw, land, land, empty)
    low_rank = (a_desc, a_desc, 0.0, a_smem, a_smem, land, empty)
    gl.warp_specialize([
        (_math_ceiling, (sa, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_om, smem, _UPPER, E_P2,
                         GROUP_M, STAGES, MODE, EPI)),
        (_math_ceiling, (sa, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_om, smem, _LOWER, E_P2,
                         GROUP_M, STAGES, MODE, EPI)),
        (_producer, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, False,
                     E_P2, GROUP_M, STAGES, 0, False, False)),
    ], [4, 4], [MATH_REGS, PRODUCER_REGS])


def ceiling_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, mode: int,
               out: torch.Tensor | None = None, stages: int = 4, epi: bool = False) -> torch.Tensor:
    """The launch of :func:`ceiling_kernel` as ``grouped_mm_gluon`` launches the forward (``a`` e4m3 ``[M, K]``,
    ``weight`` e4m3 ``[E, N, K]``); ``stages`` in the ring, ``epi``: the result through shared memory
    (``_store``'s ``COALESCED``)."""
    cfg = launch_settings(False)
    m, c = a.shape
    e, n_w, k_w = weight.shape
    out = torch.empty((m, n_w), dtype=torch.bfloat16, device=a.device) if out is None else out
    walk = tile_walk(offs, m, n_w, BM.value, BN.value)
    a_desc, w_desc = tile_descs(a, weight, BM.value, BN.value)
    ceiling_kernel[walk.grid](a_desc, w_desc, a_scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n,
                              a_scale.stride(0), out.stride(0), E_P2=walk.e_p2, GROUP_M=cfg["GROUP_M"],
                              STAGES=stages, MODE=mode, EPI=epi, MATH_REGS=cfg["MATH_REGS"],
                              PRODUCER_REGS=cfg["PRODUCER_REGS"], num_warps=4)
    return out


# (MODE, stages, coalesced epilogue): MODE 0 no promotion, MODE 1 the promotion with the scales read once a tile
VARIANTS = [(0, 4, False), (0, 6, False), (0, 4, True), (0, 6, True), (1, 4, False), (1, 4, True), (1, 6, True)]


def main() -> None:
    """Each mode on the dense shapes and the MoE's forward shapes, beside the kernel itself."""
    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for name, q, s, offs, m in forward_cases(dev, gen, ((16384, 4096, 2048), (16384, 2048, 4096))):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[2], device=dev, generator=gen, dtype=torch.bfloat16))
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        bench(name, "kernel (default)", partial(grouped_mm_gluon, qa, sa, q, s, offs, False), flop)
        for mode, stages, epi in VARIANTS:
            bench(name, f"MODE {mode}, {stages} stages{', coalesced' if epi else ''}",
                  partial(ceiling_mm, qa, sa, q, offs, mode, stages=stages, epi=epi), flop)


if __name__ == "__main__":
    main()

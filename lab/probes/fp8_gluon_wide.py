"""The Gluon FP8 forward over 64 x 256 tiles (``csattn.ops.fp8.gluon_wide``, the op's forward up to
``WIDE_ROWS_PER_EXPERT`` rows an expert) beside the kernel's 128 x 128: on a dense group and the MoE's forwards, its
output against the kernel's (bit for bit), its pipeline with no promotion (``MODE 0`` here: the ceiling of the shape),
other stages and ``GROUP_M``; then the frozen MoE forward + input gradient with the op's forward on the wide tiles,
beside the default and bf16 experts.

Why: at 256 experts top-6 and 16k tokens the groups' last row tiles are partly empty: 128-row tiles hold 1.150x the
rows, 64-row tiles 1.075x (see ``gluon_wide``). Run on a GPU of sm_90: python -m lab.probes.fp8_gluon_wide
"""

from __future__ import annotations

from functools import partial
from unittest import mock

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

import csattn.ops.fp8.gluon_wide as fp8_wide
from csattn.ops.fp8.gluon import _LOWER, _UPPER, _issue, _store, tile_descs
from csattn.ops.fp8.gluon_tiles import BK, _tile, acc_layout, tile_walk
from csattn.ops.fp8.gluon_wide import TM, TN, _producer_wide, grouped_mm_gluon_wide
from lab.probes.gluon_forms import bench, forward_cases, forward_ring, frozen_moe_ms


@gluon.jit
def _math_ceiling(table, out, KC, E, tiles_m, tiles_n, stride_om, smem, HALF: gl.constexpr, E_P2: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Math warpgroup ``HALF`` of the ceiling: the tile's 64 rows by columns ``[128 HALF, 128 HALF + 128)``, one
    accumulator chain, no scales (a step's product waited for at the round's end only)."""
    ACC: gl.constexpr = acc_layout()
    a_smem, b_smem, land, empty = smem
    zero = gl.zeros([64, 128], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=TM)
        block = pid_n * 2 + HALF
        if g < E:
            acc = zero
            for r in range(nk // 4):
                j = it + 4 * r
                for i in gl.static_range(4):
                    acc = _issue(a_smem, b_smem, land, acc, j + i, HALF, STAGES, True)
                    if i > 0:
                        acc = warpgroup_mma_wait(1, deps=[acc])
                        mbarrier.arrive(empty.index((j + i - 1) % STAGES), count=1)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(empty.index((j + 3) % STAGES), count=1)
            it += nk
            _store(out, acc, row0, row_end, block, stride_om, True)
        elif g == E:
            _store(out, zero, row0, row_end, block, stride_om, True)


@gluon.jit
def ceiling_kernel(a_desc, w_desc, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_om, E_P2: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """The wide forward's pipeline with no promotion (the contraction a multiple of 512: the probe's shapes)."""
    smem = forward_ring(STAGES, TM, TN)
    gl.warp_specialize([
        (_math_ceiling, (table, out, KC, E, tiles_m, tiles_n, stride_om, smem, _UPPER, E_P2, GROUP_M, STAGES)),
        (_math_ceiling, (table, out, KC, E, tiles_m, tiles_n, stride_om, smem, _LOWER, E_P2, GROUP_M, STAGES)),
        (_producer_wide, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, smem, E_P2, GROUP_M, STAGES,
                          False)),
    ], [4, 4], [232, 40])


def ceiling_mm(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, stages: int = 4,
               group_m: int = 8) -> torch.Tensor:
    """``a`` e4m3 ``[M, K]`` by ``weight`` e4m3 ``[E, N, K]`` unscaled over the wide tiles, bf16 ``[M, N]``."""
    m, c = a.shape
    e, n_w, k_w = weight.shape
    out = torch.empty((m, n_w), dtype=torch.bfloat16, device=a.device)
    walk = tile_walk(offs, m, n_w, TM.value, TN.value)
    a_desc, w_desc = tile_descs(a, weight, TM.value, TN.value)
    ceiling_kernel[walk.grid](a_desc, w_desc, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n, out.stride(0),
                              E_P2=walk.e_p2, GROUP_M=group_m, STAGES=stages, num_warps=4)
    return out


# settings of the wide kernel beside its defaults
VARIANTS = {"5 stages": {"STAGES": 5}, "GROUP_M 16": {"GROUP_M": 16}}


def main() -> None:
    """Each way beside the kernel (128 x 128 tiles), in CUDA graphs, on a dense group and the MoE's forwards; the wide
    kernel's output against the kernel's; then the frozen MoE with the op's forward wide."""
    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for name, q, s, offs, m in forward_cases(dev, gen, ((16384, 4096, 2048),)):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[2], device=dev, generator=gen, dtype=torch.bfloat16))
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        base = grouped_mm_gluon(qa, sa, q, s, offs, False)
        bench(name, "kernel, 128 x 128", partial(grouped_mm_gluon, qa, sa, q, s, offs, False), flop)
        for way, settings in {"64 x 256": None, **VARIANTS}.items():
            call = partial(grouped_mm_gluon_wide, qa, sa, q, s, offs, settings=settings)
            try:
                print(f"{name:16s} {way:44s} equal to the kernel {torch.equal(call(), base)}", flush=True)
            except Exception as err:
                print(f"{name:16s} {way:44s} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
            bench(name, way, call, flop)
        bench(name, "64 x 256, no promotion (ceiling)", partial(ceiling_mm, qa, q, offs), flop)
    bf16 = frozen_moe_ms("bf16")
    for run in range(2):  # alternating: the card's clocks drift between calls
        for way, wide in (("default (128 x 128)", False), ("forward on 64 x 256 tiles", True)):
            with mock.patch.object(fp8_wide, "WIDE_FORWARD", wide):
                ms = frozen_moe_ms("fp8")
            print(f"frozen MoE fwd + input grad, run {run}: FP8 {way} {ms:.2f} ms ({bf16 / ms:.2f}x bf16 {bf16:.2f})",
                  flush=True)


if __name__ == "__main__":
    main()

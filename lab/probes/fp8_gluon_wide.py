"""The Gluon FP8 forward with 64 x 256 tiles: a program's 64 rows against two 128-column blocks of the weight, one a
math warpgroup (each warpgroup's product as in the kernel: ``m64n128``, the same registers), where the kernel runs
128 x 128 tiles whose two warpgroups split the rows.

Why: at 256 experts top-6 and 16k tokens the groups' last row tiles are partly empty: 128-row tiles hold 1.150x the
rows, 64-row tiles 1.075x. On an H100 at d5940f4 the forward's pipeline with no promotion ran gate_up at 3.74 ms,
1016 TFLOP/s counting the rows of its tiles: the dense rate (1040-1074), so at the MoE's shapes the forward loses to
the empty rows what it does not lose to cuBLAS. A 64-row tile halves that loss; the price is the weight's tile
copied for 64 rows instead of 128 (25 % more bytes from L2 a product). ``MODE 0``: no promotion (the ceiling);
``MODE 1``: the kernel's math (its promotion, per-step scales), whose output must equal the kernel's bit for bit
(each output's products and additions in the same order). Run on a GPU of sm_90: python -m lab.probes.fp8_gluon_wide
"""

from __future__ import annotations

from functools import partial

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from csattn.ops.backend import sm_count
from csattn.ops.fp8.gluon import _LOWER, _UPPER, _promote, _scales, _store
from csattn.ops.fp8.gluon_tiles import BK, _tile, _tma_load, acc_layout, group_table, tile_smem
from lab.probes.gluon_forms import bench, forward_cases, forward_ring

TM: gl.constexpr = gl.constexpr(64)  # rows of a tile
TN: gl.constexpr = gl.constexpr(256)  # columns of a tile: a 128-column block a math warpgroup


@gluon.jit
def _producer_wide(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Every TMA copy: a step's ``[64, 128]`` activation tile and ``[256, 128]`` weight tile into the ring."""
    a_smem, b_smem, land, empty = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=TM)
        if g < E:
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(land.index(s), TM * BK + TN * BK)
                _tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                _tma_load(w_desc, [g * W_ROWS + pid_n * TN, kb * BK], land.index(s), b_smem.index(s))
                it += 1


@gluon.jit
def _issue_wide(a_smem, b_smem, land, zero, j, HALF: gl.constexpr, STAGES: gl.constexpr, USE_ACC: gl.constexpr):
    """Once stage ``j`` has landed, start this warpgroup's product: the tile's 64 rows by its 128 columns."""
    s = j % STAGES
    mbarrier.wait(land.index(s), (j // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), b_smem.index(s).slice(HALF * 128, 128, dim=0).permute((1, 0)), zero,
                         use_acc=USE_ACC, is_async=True)


@gluon.jit
def _math_wide(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
               stride_sbn, stride_om, smem, HALF: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, MODE: gl.constexpr):
    """Math warpgroup ``HALF``: the tile's 64 rows by columns ``[128 HALF, 128 HALF + 128)``; the kernel's loop
    (``MODE 1``) or one accumulator with no scales (``MODE 0``)."""
    ACC: gl.constexpr = acc_layout()
    a_smem, b_smem, land, empty = smem
    zero = gl.zeros([64, 128], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=TM)
        block = pid_n * 2 + HALF  # this warpgroup's 128-column block
        if g < E:
            rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
            rmask = rows < row_end
            sa_ptrs = sa + rows.to(gl.int64) * stride_sam
            sw_ptr = sw + g.to(gl.int64) * stride_swe + block * stride_sbn
            acc = zero
            for r in range(nk // 4):
                j = it + 4 * r
                if MODE == 0:  # one chain, no scales (a step's product waited for at the round's end only)
                    for i in gl.static_range(4):
                        acc = _issue_wide(a_smem, b_smem, land, acc, j + i, HALF, STAGES, True)
                        if i > 0:
                            acc = warpgroup_mma_wait(1, deps=[acc])
                            mbarrier.arrive(empty.index((j + i - 1) % STAGES), count=1)
                    acc = warpgroup_mma_wait(0, deps=[acc])
                    mbarrier.arrive(empty.index((j + 3) % STAGES), count=1)
                else:  # the kernel's overlapped promotion
                    sc0 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r, stride_sak, stride_sbk)
                    t0 = _issue_wide(a_smem, b_smem, land, zero, j, HALF, STAGES, False)
                    sc1 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 1, stride_sak, stride_sbk)
                    t1 = _issue_wide(a_smem, b_smem, land, zero, j + 1, HALF, STAGES, False)
                    acc = _promote(acc, t0, sc0, empty, j, 1, STAGES)
                    sc2 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 2, stride_sak, stride_sbk)
                    t2 = _issue_wide(a_smem, b_smem, land, zero, j + 2, HALF, STAGES, False)
                    acc = _promote(acc, t1, sc1, empty, j + 1, 1, STAGES)
                    sc3 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 3, stride_sak, stride_sbk)
                    t3 = _issue_wide(a_smem, b_smem, land, zero, j + 3, HALF, STAGES, False)
                    acc = _promote(acc, t2, sc2, empty, j + 2, 1, STAGES)
                    acc = _promote(acc, t3, sc3, empty, j + 3, 0, STAGES)
            it += nk
            _store(out, acc, row0, row_end, block, stride_om, True)
        elif g == E:  # rows past offs[-1]
            _store(out, zero, row0, row_end, block, stride_om, True)


@gluon.jit
def wide_kernel(a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam, stride_sak,
                stride_swe, stride_sbk, stride_sbn, stride_om, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr, MODE: gl.constexpr):
    """The forward (``TRANS`` off, no low-rank term) over ``[64, 256]`` tiles; the contraction a multiple of 512
    (four steps a round, no tail loop: the probe's shapes)."""
    smem = forward_ring(STAGES, TM, TN)
    gl.warp_specialize([
        (_math_wide, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                      stride_sbn, stride_om, smem, _UPPER, E_P2, GROUP_M, STAGES, MODE)),
        (_math_wide, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                      stride_sbn, stride_om, smem, _LOWER, E_P2, GROUP_M, STAGES, MODE)),
        (_producer_wide, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES)),
    ], [4, 4], [232, 40])


def wide_mm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
            mode: int, stages: int = 4, group_m: int = 8) -> torch.Tensor:
    """``a`` e4m3 ``[M, K]`` (scales ``[M, K / 128]`` row-major) by ``weight`` e4m3 ``[E, N, K]`` (scales ``[E, N /
    128, K / 128]``) over :func:`wide_kernel`'s tiles, bf16 ``[M, N]``; ``N`` a multiple of 256, ``K`` of 512."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, c = a.shape
    e, n_w, k_w = weight.shape
    assert n_w % TN.value == 0 and k_w % (4 * BK.value) == 0 and a_scale.stride(1) == 1
    out = torch.empty((m, n_w), dtype=torch.bfloat16, device=a.device)
    e_p2 = max(128, triton.next_power_of_2(e + 2))
    table = group_table(offs, m, e_p2, bm=TM.value)
    layout = tile_smem()
    a_desc = TensorDescriptor(a, [m, c], [c, 1], [TM.value, BK.value], layout)
    w_desc = TensorDescriptor(weight.view(e * n_w, k_w), [e * n_w, k_w], [k_w, 1], [TN.value, BK.value], layout)
    tiles_m, tiles_n = triton.cdiv(m, TM.value) + e + 1, n_w // TN.value
    grid = (min(tiles_m * tiles_n, sm_count(a.device)),)
    wide_kernel[grid](a_desc, w_desc, a_scale, scale, table, out, c, e, n_w, tiles_m, tiles_n, a_scale.stride(0),
                      a_scale.stride(1), scale.stride(0), scale.stride(2), scale.stride(1), out.stride(0), E_P2=e_p2,
                      GROUP_M=group_m, STAGES=stages, MODE=mode, num_warps=4)
    return out


# (MODE, stages, GROUP_M)
VARIANTS = [(1, 4, 8), (0, 4, 8), (1, 5, 8), (1, 4, 16)]


def main() -> None:
    """Each variant beside the kernel (128 x 128 tiles), in CUDA graphs, on a dense group and the MoE's forwards;
    ``MODE 1``'s output against the kernel's."""
    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for name, q, s, offs, m in forward_cases(dev, gen, ((16384, 4096, 2048),)):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[2], device=dev, generator=gen, dtype=torch.bfloat16))
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        base = grouped_mm_gluon(qa, sa, q, s, offs, False)
        bench(name, "kernel, 128 x 128", partial(grouped_mm_gluon, qa, sa, q, s, offs, False), flop)
        for mode, stages, group_m in VARIANTS:
            way = f"64 x 256, MODE {mode}, {stages} stages, GROUP_M {group_m}"
            call = partial(wide_mm, qa, sa, q, s, offs, mode, stages, group_m)
            if mode == 1:
                try:
                    print(f"{name:16s} {way:44s} equal to the kernel {torch.equal(call(), base)}", flush=True)
                except Exception as err:
                    print(f"{name:16s} {way:44s} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
            bench(name, way, call, flop)


if __name__ == "__main__":
    main()

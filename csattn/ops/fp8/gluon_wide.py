"""The Gluon FP8 forward over ``[64, 256]`` tiles (``WIDE``): a program's 64 rows against two 128-column blocks of
the weight, one a math warpgroup, where :mod:`.gluon` runs ``[128, 128]`` tiles whose two math warpgroups split the
rows. Each warpgroup's products, scales and promotion are :mod:`.gluon`'s (``m64n128k32``, the same registers), so
the output is the same bit for bit; only the tiles' shape differs.

Why: at 256 experts top-6 and 16k tokens the groups' last row tiles are partly empty: 128-row tiles hold 1.150x the
routed rows, 64-row tiles 1.075x. On an H100 at d5940f4 the forward's pipeline without the promotion ran gate_up at
1016 TFLOP/s counting the rows of its tiles, the dense rate: at the MoE's shapes the forward loses to empty rows what
it does not lose to its pipeline. The price: the weight's tile is copied for 64 rows instead of 128 (25 % more bytes
from L2 a product).

Measured on the H200 at 3b601d6 (``lab.probes.fp8_gluon_wide``, CUDA graphs;
``lab/results/finetune_h200/wide_probe_3b601d6.txt``): at ~384 rows an expert gate_up 3.915 ms against 4.141 and
down 2.188 against 2.314 (5.5 % faster); on one dense group of 16384 rows 0.326 ms against 0.305 (7 % slower). So
the op takes it up to :data:`WIDE_ROWS_PER_EXPERT` rows an expert on average (:func:`takes_wide`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .gluon import _LOWER, _UPPER, _contract, _store, low_rank_descs, prepared, tile_descs
from .gluon_low_rank import _acc_start, _load_low_rank, _low_rank_ring
from .gluon_tiles import BK, _tile, _tma_load, acc_layout, tile_smem, tile_walk

__all__ = ["WIDE_FORWARD", "WIDE_ROWS_PER_EXPERT", "grouped_mm_gluon_wide", "takes_wide", "wide_fits"]

WIDE_FORWARD = True  # the op's forward over [64, 256] tiles where takes_wide holds (off: the [128, 128] kernel always)
# Up to this many rows an expert on average the forward runs [64, 256] tiles: measured faster at ~384 (the slice at
# 16k tokens), slower on one dense group; between them (the slice at 64k: ~1536) unmeasured, so the [128, 128] kernel
WIDE_ROWS_PER_EXPERT = 512
TM: gl.constexpr = gl.constexpr(64)  # rows of a tile
TN: gl.constexpr = gl.constexpr(256)  # columns of a tile: a 128-column block a math warpgroup


@gluon.jit
def _producer_wide(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, E_P2: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOW_RANK: gl.constexpr):
    """Every TMA copy: a step's ``[64, 128]`` activation tile and ``[256, 128]`` weight tile into the ring, and a
    tile's low-rank operands (``v`` ``[64, R]``, ``w`` ``[256, R]``) a tile ahead."""
    a_smem, b_smem, land, empty = smem
    nk = KC // BK
    it = 0
    nt = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=TM)
        if g < E:
            if LOW_RANK:
                _load_low_rank(low_rank, nt, row0, g * (tiles_n * TN) + pid_n * TN)
                nt += 1
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # the first pass over the ring: at once
                mbarrier.expect(land.index(s), TM * BK + TN * BK)  # e4m3: a byte each
                _tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                _tma_load(w_desc, [g * W_ROWS + pid_n * TN, kb * BK], land.index(s), b_smem.index(s))
                it += 1


@gluon.jit
def _math_wide(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
               stride_sbn, stride_om, smem, low_rank, HALF: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, LOW_RANK: gl.constexpr):
    """Math warpgroup ``HALF``: the tile's 64 rows by columns ``[128 HALF, 128 HALF + 128)``, :mod:`.gluon`'s
    contraction (four steps a round, the next product started before the last is promoted)."""
    ACC: gl.constexpr = acc_layout()
    a_smem, b_smem, land, empty = smem
    zero = gl.zeros([64, 128], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    nt = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=TM)
        block = pid_n * 2 + HALF  # this warpgroup's 128-column block of the output
        if g < E:
            rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
            rmask = rows < row_end
            sa_ptrs = sa + rows.to(gl.int64) * stride_sam
            sw_ptr = sw + g.to(gl.int64) * stride_swe + block * stride_sbn
            acc, nt = _acc_start(low_rank, nt, zero, HALF, LOW_RANK, WIDE=True)
            acc = _contract(acc, zero, a_smem, b_smem, land, empty, sa_ptrs, sw_ptr, rmask, it, nk, stride_sak,
                            stride_sbk, HALF, STAGES, False, True)
            it += nk
            _store(out, acc, row0, row_end, block, stride_om, True)
        elif g == E:  # rows past offs[-1]
            _store(out, zero, row0, row_end, block, stride_om, True)


@gluon.jit
def fp8_grouped_gluon_wide_kernel(
    a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
    stride_sbk, stride_sbn, stride_om, v_desc, lw_desc, l_scale, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LOW_RANK: gl.constexpr = False,
):
    """``out[rows of e] = a[rows of e] @ W_e^T`` over ``[64, 256]`` tiles: :func:`.gluon.fp8_grouped_gluon_kernel`'s
    forward (same arguments but the descriptors' blocks: ``a_desc`` ``[64, 128]``, ``w_desc`` ``[256, 128]``,
    ``v_desc`` ``[64, R]``, ``lw_desc`` ``[256, R]``)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TM, BK], tile_smem())
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TN, BK], tile_smem())
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)  # the expect; the copies' bytes
        mbarrier.init(empty.index(s), count=2)  # each math warpgroup, once its MMA on the stage is done
    smem = (a_smem, b_smem, land, empty)
    low_rank = _low_rank_ring(v_desc, lw_desc, l_scale, a_smem, land, empty, LOW_RANK)
    gl.warp_specialize([
        (_math_wide, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                      stride_sbn, stride_om, smem, low_rank, _UPPER, E_P2, GROUP_M, STAGES, LOW_RANK)),
        (_math_wide, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                      stride_sbn, stride_om, smem, low_rank, _LOWER, E_P2, GROUP_M, STAGES, LOW_RANK)),
        (_producer_wide, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, E_P2, GROUP_M,
                          STAGES, LOW_RANK)),
    ], [4, 4], [MATH_REGS, PRODUCER_REGS])


# 4 stages of 40 KB (160 KB), the epilogue's 16 KB, the low-rank term's 20 KB; the forward's register split
WIDE_SETTINGS = dict(GROUP_M=8, STAGES=4, MATH_REGS=232, PRODUCER_REGS=40)


def wide_fits(weight: Tensor) -> bool:
    """Whether the forward over ``[64, 256]`` tiles takes the weight ``[E, N, K]``: ``N`` a multiple of 256 (the
    Gluon kernel's own bounds, ``grouped.gluon_fits``, hold already)."""
    return weight.shape[-2] % TN.value == 0


def takes_wide(rows: int, weight: Tensor) -> bool:
    """Whether the op's forward of ``rows`` expert-sorted rows runs over ``[64, 256]`` tiles: :data:`WIDE_FORWARD`
    on, the weight fits (:func:`wide_fits`), and at most :data:`WIDE_ROWS_PER_EXPERT` rows an expert on average."""
    return WIDE_FORWARD and wide_fits(weight) and rows <= WIDE_ROWS_PER_EXPERT * weight.shape[0]


def grouped_mm_gluon_wide(a: Tensor, a_scale: Tensor, weight: Tensor, scale: Tensor, offs: Tensor,
                          out_dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None,
                          low_rank: tuple[Tensor, Tensor, float] | None = None,
                          settings: dict | None = None) -> Tensor:
    """:func:`.gluon.grouped_mm_gluon`'s forward (``trans=False``) over ``[64, 256]`` tiles, bit for bit its output:
    ``a`` e4m3 ``[M, K]`` with its 1x128 scales (row-major or the transposed view), ``weight`` e4m3 ``[E, N, K]`` (``N``
    a multiple of 256, :func:`wide_fits`) and its 128x128 scales; ``low_rank`` as there. ``settings`` over
    :data:`WIDE_SETTINGS` (measurements)."""
    if not wide_fits(weight):
        raise ValueError(f"the [64, 256] tiles take weights whose N is a multiple of 256, got {tuple(weight.shape)}")
    cfg = {**WIDE_SETTINGS, **(settings or {})}
    m, c = a.shape
    e, n_w, k_w = weight.shape
    a, a_scale, weight, scale, out = prepared(a, a_scale, weight, scale, out, n_w, out_dtype)
    if m == 0:
        return out
    walk = tile_walk(offs, m, n_w, TM.value, TN.value)
    a_desc, w_desc = tile_descs(a, weight, TM.value, TN.value)
    v_desc, lw_desc, l_scale = ((a_desc, a_desc, 0.0) if low_rank is None
                                else low_rank_descs(*low_rank, m, e, n_w, TM.value, TN.value))
    fp8_grouped_gluon_wide_kernel[walk.grid](
        a_desc, w_desc, a_scale, scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n, a_scale.stride(0),
        a_scale.stride(1), scale.stride(0), scale.stride(2), scale.stride(1), out.stride(0), v_desc, lw_desc, l_scale,
        E_P2=walk.e_p2, **cfg, LOW_RANK=low_rank is not None, num_warps=4)
    return out

"""The Gluon FP8 forward over ``[64, 256]`` tiles (``WIDE``): a program's 64 rows against two 128-column blocks of
the weight, one a math warpgroup, where :mod:`.gluon` runs ``[128, 128]`` tiles whose two math warpgroups split the
rows. Each warpgroup's products, scales and promotion are :mod:`.gluon`'s (``m64n128k32``, the same registers), so
the output is the same bit for bit; only the tiles' shape differs.

Why: at 256 experts top-6 and 16k tokens the groups' last row tiles are partly empty: 128-row tiles hold 1.150x the
routed rows, 64-row tiles 1.075x. On an H100 at d5940f4 the forward's pipeline without the promotion ran gate_up at
1016 TFLOP/s counting the rows of its tiles, the dense rate: at the MoE's shapes the forward loses to empty rows what
it does not lose to its pipeline. The price: the weight's tile is copied for 64 rows instead of 128 (25 % more bytes
from L2 a product). Off by default (:data:`WIDE_FORWARD`) until measured (``lab.probes.fp8_gluon_fwd``).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

from ..backend import sm_count
from .gluon import _LOWER, _UPPER, _promote, _scales, _store, low_rank_descs
from .gluon_low_rank import _acc_start, _load_low_rank
from .gluon_tiles import BK, _tile, _tma_load, acc_layout, group_table, tile_smem

__all__ = ["WIDE_FORWARD", "grouped_mm_gluon_wide", "wide_fits"]

WIDE_FORWARD = False  # the op's forward over [64, 256] tiles: off until measured against the [128, 128] kernel
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
def _issue_wide(a_smem, b_smem, land, zero, j, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Once stage ``j`` has landed, start this warpgroup's product: the tile's 64 rows by its 128 columns."""
    s = j % STAGES
    mbarrier.wait(land.index(s), (j // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), b_smem.index(s).slice(HALF * 128, 128, dim=0).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _math_wide(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
               stride_sbn, stride_om, smem, low_rank, HALF: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, LOW_RANK: gl.constexpr):
    """Math warpgroup ``HALF``: the tile's 64 rows by columns ``[128 HALF, 128 HALF + 128)``, :mod:`.gluon`'s loop
    (four steps a round, the next product started before the last is promoted), then its steps past the rounds."""
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
            for r in range(nk // 4):
                j = it + 4 * r
                sc0 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r, stride_sak, stride_sbk)
                t0 = _issue_wide(a_smem, b_smem, land, zero, j, HALF, STAGES)
                sc1 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 1, stride_sak, stride_sbk)
                t1 = _issue_wide(a_smem, b_smem, land, zero, j + 1, HALF, STAGES)
                acc = _promote(acc, t0, sc0, empty, j, 1, STAGES)
                sc2 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 2, stride_sak, stride_sbk)
                t2 = _issue_wide(a_smem, b_smem, land, zero, j + 2, HALF, STAGES)
                acc = _promote(acc, t1, sc1, empty, j + 1, 1, STAGES)
                sc3 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 3, stride_sak, stride_sbk)
                t3 = _issue_wide(a_smem, b_smem, land, zero, j + 3, HALF, STAGES)
                acc = _promote(acc, t2, sc2, empty, j + 2, 1, STAGES)
                acc = _promote(acc, t3, sc3, empty, j + 3, 0, STAGES)
            for kb in range(nk // 4 * 4, nk):
                sc0 = _scales(sa_ptrs, sw_ptr, rmask, kb, stride_sak, stride_sbk)
                t0 = _issue_wide(a_smem, b_smem, land, zero, it + kb, HALF, STAGES)
                acc = _promote(acc, t0, sc0, empty, it + kb, 0, STAGES)
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
    if LOW_RANK:  # two buffers of the low-rank term's tiles: the producer fills one tile ahead
        v_buf = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        w_buf = gl.allocate_shared_memory(lw_desc.dtype, [2] + lw_desc.block_type.shape, lw_desc.layout)
        lr_land = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        lr_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(lr_land.index(b), count=1)
            mbarrier.init(lr_empty.index(b), count=2)
        low_rank = (v_desc, lw_desc, l_scale, v_buf, w_buf, lr_land, lr_empty)
    else:
        low_rank = (v_desc, lw_desc, l_scale, a_smem, a_smem, land, empty)
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


def grouped_mm_gluon_wide(a: Tensor, a_scale: Tensor, weight: Tensor, scale: Tensor, offs: Tensor,
                          out_dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None,
                          low_rank: tuple[Tensor, Tensor, float] | None = None,
                          settings: dict | None = None) -> Tensor:
    """:func:`.gluon.grouped_mm_gluon`'s forward (``trans=False``) over ``[64, 256]`` tiles, bit for bit its output:
    ``a`` e4m3 ``[M, K]`` with its 1x128 scales (row-major or the transposed view), ``weight`` e4m3 ``[E, N, K]`` (``N``
    a multiple of 256, :func:`wide_fits`) and its 128x128 scales; ``low_rank`` as there. ``settings`` over
    :data:`WIDE_SETTINGS` (measurements)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not wide_fits(weight):
        raise ValueError(f"the [64, 256] tiles take weights whose N is a multiple of 256, got {tuple(weight.shape)}")
    cfg = {**WIDE_SETTINGS, **(settings or {})}
    m, c = a.shape
    e, n_w, k_w = weight.shape
    a = a.contiguous()
    if 1 not in a_scale.stride():
        a_scale = a_scale.contiguous()
    weight, scale = weight.contiguous(), scale.contiguous()
    if out is None:
        out = torch.empty((m, n_w), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    e_p2 = max(128, triton.next_power_of_2(e + 2))
    table = group_table(offs, m, e_p2, bm=TM.value)
    layout = tile_smem()
    a_desc = TensorDescriptor(a, [m, c], [c, 1], [TM.value, BK.value], layout)
    w_desc = TensorDescriptor(weight.view(e * n_w, k_w), [e * n_w, k_w], [k_w, 1], [TN.value, BK.value], layout)
    tiles_m, tiles_n = triton.cdiv(m, TM.value) + e + 1, n_w // TN.value
    grid = (min(tiles_m * tiles_n, sm_count(a.device)),)
    v_desc, lw_desc, l_scale = ((a_desc, a_desc, 0.0) if low_rank is None
                                else low_rank_descs(*low_rank, m, e, n_w, TM.value, TN.value))
    fp8_grouped_gluon_wide_kernel[grid](
        a_desc, w_desc, a_scale, scale, table, out, c, e, n_w, tiles_m, tiles_n, a_scale.stride(0), a_scale.stride(1),
        scale.stride(0), scale.stride(2), scale.stride(1), out.stride(0), v_desc, lw_desc, l_scale, E_P2=e_p2, **cfg,
        LOW_RANK=low_rank is not None, num_warps=4)
    return out

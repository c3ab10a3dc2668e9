"""LoRA's term in the Gluon FP8 grouped GEMM (``LOW_RANK``): the producer copies each tile's ``v`` rows and ``w``
rows by TMA into one of two buffers, and each math warpgroup starts the tile's accumulator with their bf16 / fp16
product (depth ``R``) instead of zeros. Shared by the kernel's forms (:mod:`.gluon`,
:mod:`.gluon_wide`)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

from .gluon_tiles import BN, _tma_load, acc_layout


@gluon.jit
def _low_rank_ring(v_desc, lw_desc, l_scale, spare, land, empty, LOW_RANK: gl.constexpr):
    """The partitions' view of the low-rank term: with ``LOW_RANK`` its descriptors, two buffers of its tiles (the
    producer fills one a tile ahead) and their barriers (landed; free once both math warpgroups took the term); else
    the descriptors and stand-ins that nothing reads (``spare``, ``land``, ``empty``: no buffer or barrier made and
    left unused, whose bytes the allocator could give a later buffer while they hold an initialized barrier)."""
    if LOW_RANK:
        v_buf = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        w_buf = gl.allocate_shared_memory(lw_desc.dtype, [2] + lw_desc.block_type.shape, lw_desc.layout)
        lr_land = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        lr_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(lr_land.index(b), count=1)
            mbarrier.init(lr_empty.index(b), count=2)
        return (v_desc, lw_desc, l_scale, v_buf, w_buf, lr_land, lr_empty)
    else:
        return (v_desc, lw_desc, l_scale, spare, spare, land, empty)


@gluon.jit
def _load_low_rank(low_rank, nt, row0, w_row, PERMUTED: gl.constexpr = False):
    """The low-rank term's tiles of the program's ``nt``-th tile: ``v`` rows ``[row0, row0 + 128)`` (rows past ``M``
    read as zeros; rows of the next group are read, and their results not stored) and ``w`` rows ``[w_row,
    w_row + 128)``, into buffer ``nt % 2`` once the math warpgroups have released it."""
    v_desc, lw_desc, l_scale, v_buf, w_buf, lr_land, lr_empty = low_rank
    b = nt % 2
    mbarrier.wait(lr_empty.index(b), ((nt // 2) & 1) ^ 1)  # the first turn of each buffer: at once
    mbarrier.expect(lr_land.index(b), v_desc.block_type.nbytes + lw_desc.block_type.nbytes)
    _tma_load(v_desc, [row0, 0], lr_land.index(b), v_buf.index(b))
    if PERMUTED:  # .gluon.low_rank_descs(permuted=True): [4, rows / 4, R]
        _tma_load(lw_desc, [0, w_row // 4, 0], lr_land.index(b), w_buf.index(b))
    else:
        _tma_load(lw_desc, [w_row, 0], lr_land.index(b), w_buf.index(b))


@gluon.jit
def _low_rank_start(low_rank, nt, HALF: gl.constexpr, WIDE: gl.constexpr = False, PERMUTED: gl.constexpr = False):
    """The accumulator's start for the program's ``nt``-th tile: ``l_scale * v[rows] @ w^T`` (this warpgroup's 64
    rows), one bf16 / fp16 MMA of depth ``R``; the contraction's products are added to it. ``WIDE`` (``[64, 256]``
    tiles, :mod:`.gluon_wide`): the tile's 64 rows by this warpgroup's 128 columns. ``PERMUTED``: ``w``'s rows were
    copied in the input gradient's permuted column order (``.gluon.low_rank_descs(permuted=True)``), so the term's
    columns come in the order of the product's."""
    v_desc, lw_desc, l_scale, v_buf, w_buf, lr_land, lr_empty = low_rank
    b = nt % 2
    mbarrier.wait(lr_land.index(b), (nt // 2) & 1)
    # the instruction's depth is part of the accumulator's layout type (16 for 16-bit operands, 32 for e4m3); the
    # registers of the two are the same
    LO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    if WIDE:
        lo = warpgroup_mma(v_buf.index(b), w_buf.index(b).slice(HALF * 128, 128, dim=0).permute((1, 0)),
                           gl.zeros([64, 128], gl.float32, layout=LO), use_acc=False)
    else:
        wt = w_buf.index(b)
        if PERMUTED:  # copied [4, 32, R] with its rows in the permuted weight tile's order (.gluon.permuted_w_desc)
            wt = wt.reshape([BN, wt.shape[2]])
        lo = warpgroup_mma(v_buf.index(b).slice(HALF * 64, 64, dim=0), wt.permute((1, 0)),
                           gl.zeros([64, BN], gl.float32, layout=LO), use_acc=False)
    mbarrier.arrive(lr_empty.index(b), count=1)
    return gl.convert_layout(lo * l_scale, acc_layout())


@gluon.jit
def _acc_start(low_rank, nt, zero, HALF: gl.constexpr, LOW_RANK: gl.constexpr, WIDE: gl.constexpr = False,
               PERMUTED: gl.constexpr = False):
    """A math warpgroup's accumulator at the start of the program's next tile, and the count of tiles that took the
    low-rank term: its start (:func:`_low_rank_start`) with ``LOW_RANK``, else ``zero``."""
    if LOW_RANK:
        return _low_rank_start(low_rank, nt, HALF, WIDE, PERMUTED), nt + 1
    else:
        return zero, nt

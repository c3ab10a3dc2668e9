"""The input gradient of the Gluon FP8 grouped GEMM without a transposition in shared memory (``SWAP``, see
``README.md``): each tile's transpose ``W_e^T dY^T``, the weight the MMA's ``A`` operand read transposed into
registers (Hopper's FP8 MMA takes K-major operands from shared memory only), ``dY``'s tile its ``B`` operand as
copied. The math warpgroups' partition; the producer and the kernel are :mod:`.gluon`'s."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_low_rank import _acc_start
from .gluon_tiles import BK, BM, BN, _reinterpret, _tile, acc_layout


def operand_columns() -> list[int]:
    """The output column (within a warpgroup's 64) of each row of SWAP's operand and accumulator (what
    :func:`_swap_rows` does to the rows, as a list): a thread's rows ``i`` and ``i + 8`` are columns ``c`` and ``c +
    1``. The launcher orders the low-rank term's ``w`` rows by it."""
    return [(i & 0x30) | ((i >> 3) & 1) | ((i & 7) << 1) for i in range(64)]


@gluon.constexpr_function
def dot_layout():
    """Register layout of a math warpgroup's FP8 ``A`` operand ``[64, BK]`` (``SWAP``: the weight's rows)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout(), k_width=4)


@gluon.constexpr_function
def tile_smem16():
    """:func:`tile_smem` read as ``[BK, BN / 2]`` 16-bit elements (the same bytes: a 128-byte row, 16-byte chunks)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.constexpr_function
def pairs_layout():
    """``[BK, 32]`` 16-bit pairs of a weight half ``[BK (contraction), 64 (output columns)]`` as ``ldmatrix.trans``
    reads them: an 8 x 8 matrix of pairs a lane group, lane ``q = lane % 4`` given contraction rows ``4q`` and ``4q
    + 1`` (its operand's rows ``4q .. 4q + 3`` come from two matrices: the ``2`` register basis), lane ``lane // 4``
    a pair of output columns; warps walk the pairs by 8. Composed with :func:`swap_rows` this is
    :func:`dot_layout` up to the order of a thread's registers (a permutation within each thread, no data
    movement between threads)."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [16, 0], [32, 0], [64, 0]],
                                      lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
                                      warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[128, 32])


@gluon.constexpr_function
def swap_store_layout():
    """``[BM (rows), 64 (output columns)]`` of a ``SWAP`` result: the accumulator's layout transposed and relabeled
    (:func:`swap_rows`), a thread's two adjacent columns first (4-byte stores; 8 lanes fill 32 bytes of a row)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [8, 0], [16, 0], [32, 0], [64, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
                                      warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[128, 64])


@gluon.jit
def _swap_rows(x, FORWARD: gl.constexpr):
    """Relabel the 64 rows of ``x [64, C]`` (no data movement: the bits of the row index permuted). ``FORWARD``: the
    output columns of a weight half, bits ``(b5 .. b0)``, become the operand rows ``(b5, b4, b0, b3, b2, b1)``, so
    the two rows 8 apart that a thread holds in the MMA's layouts are two adjacent columns (one 16-bit pair of the
    weight, one 4-byte store of the result); else the inverse."""
    C: gl.constexpr = x.shape[1]
    x = gl.reshape(x, [2, 2, 2, 2, 2, 2, C])
    if FORWARD:
        x = gl.permute(x, (0, 1, 5, 2, 3, 4, 6))
    else:
        x = gl.permute(x, (0, 1, 3, 4, 5, 2, 6))
    return gl.reshape(x, [64, C])


@gluon.jit
def _weight_operand(tile, HALF: gl.constexpr):
    """``SWAP``: math warpgroup ``HALF``'s FP8 ``A`` operand ``[64, BK]`` from the weight tile ``[BK, BN]`` as copied
    (contraction-major): its output columns ``[64 HALF, 64 HALF + 64)`` transposed, rows relabeled by
    :func:`_swap_rows`. Read as 16-bit pairs by ``ldmatrix.trans`` (:func:`pairs_layout`; FP8's ``ldmatrix`` has no
    transposing form on sm_90), the pairs' bytes then sorted within each thread's registers."""
    tile16 = _reinterpret(tile, gl.int16, [BK, BN // 2], tile_smem16())
    pairs = tile16.slice(HALF * 32, 32, dim=1).load(pairs_layout())
    lo = (pairs & 0xFF).to(gl.int8)
    hi = (pairs >> 8).to(gl.int8)
    half = gl.reshape(gl.join(lo, hi), [BK, 64]).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(_swap_rows(gl.permute(half, (1, 0)), True), dot_layout())


@gluon.jit
def _hold(x):
    """A use of ``x``'s registers the compiler keeps here (an asm with effects). An MMA in flight reads its register
    operand until its wait, but the compiler sees its last use at the MMA's start and may give the registers to a
    value made before the wait (the wait takes no 8-bit dependencies to say otherwise)."""
    gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int8, is_pure=False, pack=4)


@gluon.jit
def _store_swap(out, acc, row0, row_end, pid_n, stride_om, HALF: gl.constexpr):
    """A ``SWAP`` math warpgroup's ``[64, BM]`` result (columns by rows) into ``out``'s rows ``[row0, row_end)``,
    columns ``pid_n BN + 64 HALF + [0, 64)``."""
    L: gl.constexpr = swap_store_layout()
    x = gl.convert_layout(gl.permute(_swap_rows(acc.to(out.dtype.element_ty), False), (1, 0)), L)
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, L))
    cols = pid_n * BN + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    ptrs = out + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, x, mask=gl.expand_dims(rows < row_end, 1))


@gluon.jit
def _math_swap(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sak, stride_swe, stride_sbk, stride_sbn,
               stride_om, smem, low_rank, HALF: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, SCALES_TMA: gl.constexpr, LOW_RANK: gl.constexpr):
    """``SWAP`` math warpgroup ``HALF`` (the input gradient without a transposition in shared memory): each tile's
    transpose ``W_e^T dY^T``, its output columns ``[64 HALF, 64 HALF + 64)`` the MMA's rows (the weight's operand in
    registers, :func:`_weight_operand`) by the tile's ``BM`` rows the MMA's columns (``dY``'s tile from shared
    memory, K-major as copied). ``sa`` is the activation's scales transposed and padded (``[KC / 128, M + BM]``, rows
    contiguous); ``SCALES_TMA``: their step's column is copied with the stage instead (``sa_smem``), and read from
    shared memory with constant offsets.
    A step's product is waited for before the next starts (two accumulators, not three: the weight's operand takes
    the registers); the other math warpgroup's product keeps the tensor cores busy meanwhile, and the next step's
    operand is read while this one's runs."""
    ACC: gl.constexpr = acc_layout()
    COLS: gl.constexpr = gl.SliceLayout(0, ACC)
    a_smem, raw, bt, land, ready, empty, sa_smem = smem
    zero = gl.zeros([64, BM], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    nt = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            cols = gl.arange(0, BM, layout=COLS)
            sw_ptr = sw + g.to(gl.int64) * stride_swe + pid_n * stride_sbn
            acc, nt = _acc_start(low_rank, nt, zero, HALF, LOW_RANK, True)  # LoRA's term, transposed, or zeros
            mbarrier.wait(land.index(it % STAGES), (it // STAGES) & 1)
            w = _weight_operand(raw.index(it % STAGES), HALF)
            for kb in range(nk):
                j = it + kb
                tok = warpgroup_mma(w, a_smem.index(j % STAGES).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                if SCALES_TMA:  # copied with the stage (rows past M read as zeros)
                    sc = sa_smem.index(j % STAGES).reshape([BM]).load(COLS)
                else:  # unmasked: the scales are padded by a tile's rows (a row past row_end is not stored)
                    sc = gl.load(sa + kb * stride_sak + row0 + cols)
                sc = sc * gl.load(sw_ptr + kb * stride_sbk)
                nxt = w
                if kb + 1 < nk:  # the next step's operand while this product runs
                    mbarrier.wait(land.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
                    nxt = _weight_operand(raw.index((j + 1) % STAGES), HALF)
                part = warpgroup_mma_wait(0, deps=[tok])
                _hold(w)  # the product read w's registers until the wait: nxt may not take them before
                mbarrier.arrive(empty.index(j % STAGES), count=1)
                acc = acc + part * gl.expand_dims(sc, 0)
                w = nxt
            it += nk
            _store_swap(out, acc, row0, row_end, pid_n, stride_om, HALF)
        elif g == E:  # rows past offs[-1]
            _store_swap(out, zero, row0, row_end, pid_n, stride_om, HALF)

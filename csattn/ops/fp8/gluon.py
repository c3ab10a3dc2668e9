"""Hopper FP8 grouped GEMM written in Gluon (Triton's explicit-layout dialect): DeepGEMM's SM90 design for the
block-scaled products of :mod:`.triton` (same contract and math; this kernel exists for speed on sm_90).

- A persistent grid (one program an SM) walks the ``[128, 128]`` output tiles; tiles find their group on the
  device as in :mod:`.triton` (the running sum of the groups' row-tile counts, kept once per program).
- Three warp-specialized partitions of a warpgroup each: a producer that issues every TMA copy into a ring of
  ``STAGES`` shared-memory stages (one 128-deep step of the contraction a stage: the activation tile and the
  weight tile) and runs ahead across tiles, and two math warpgroups that own the upper and lower 64 rows of the
  tile and share its weight tile.
- The promotion is off the MMA's critical path: each math warpgroup issues the MMA of step ``j + 1`` (into a fresh
  accumulator, asynchronously) before it waits for the one of step ``j`` and adds it times ``sa * sw`` (the scales
  loaded a step ahead), so the tensor cores hold the next product while the scaling runs.
- ``TRANS`` (the input gradient, ``dX = dY W_e``): the contraction runs along W's rows, and Hopper's FP8 MMA takes
  its operands K-major only. The producer transposes each landed weight tile from shared memory through its
  registers into a second buffer of the stage (``LAG`` steps behind its copies, so the copy's latency is hidden),
  then marks the stage ready; the math warpgroups see a K-major tile as in the forward. By default (``SPLIT``) two
  transposing warpgroups of their own take the tile's halves and the producer only copies. (Two
  other forms were measured and removed at 0b7a4de, see ``README.md``: the transposition over the copied tile
  itself, and the math warpgroups reading the weight's operand transposed into their registers.)

Needs ``N`` and ``K`` of the weight multiples of 128 (each output column tile one block of scales), 16-byte
aligned rows; ``grouped_mm_gluon`` checks and the caller falls back to the Triton kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..backend import triton_version
from .gluon_low_rank import _acc_start, _load_low_rank, _low_rank_ring
from .gluon_tiles import BK, BM, BN, _cta_sync, _tile, _tma_load, acc_layout, permuted_tile_smem, tile_smem, tile_walk

__all__ = ["FUSE_LOW_RANK", "RANK", "fp8_grouped_gluon_kernel", "grouped_mm_gluon", "launch_settings"]

RANK = 16  # the low-rank term's depth: its two buffers of two [128, R] tiles (16 KB) beside the 192 KB of stages
# The op routes the low-rank term through the kernel: on an H100 at e80df6b the MoE with LoRA (fwd + bwd, 256
# experts top-6, 16k tokens) took 21.72 ms with it against 23.45 with the term added after the kernel, and mode (a)'s
# step at 16k 319.2 ms against 333.6 (lab/results/finetune_h100/). Held to fp64 on the GPU by tests/ops/test_fp8_gpu.py
# ::test_gluon_low_rank_term_vs_same_operands; builds for sm_90 without spills (tests/ops/test_fp8_gluon_build.py).
FUSE_LOW_RANK = True
# The input gradient's transposition in two warpgroups of their own, the producer only copying (``SPLIT``), at 184 /
# 24 / 56 / 56 registers (20 warps; 2 x 184 + 24 + 2 x 56 = 512, a thread's share of 16 warps' registers). The form
# before (2dea5ed, in git up to ad10675: the producer transposing one half, LAG steps behind its copies, a fourth
# warpgroup the other; 184 / 72 / 72) ran gate_up 5.72 ms against 6.06 with the producer transposing alone, down 2.93
# against 3.23 (H100). Nsight Compute then showed its copies queued behind its own transposition (the transposers
# waited for their copies ~33 % of their samples, the math warpgroups for transposed stages ~45 %:
# lab/results/finetune_h100/ncu_stalls_1cdfd36.txt). On an H100 (lab.probes.fp8_dgrad_copier on cafadde's tree with
# the copier; lab/results/finetune_h100/dgrad_copier_cafadde.txt): gate_up 5.50 ms against 5.62, down 2.71 against
# 3.05, the same bits; the frozen MoE 16.98 / 17.03 ms against 17.18 / 17.55 (bf16 experts 21.44 / 21.48).
# Its transposers then take two steps a fence (``PAIRED``) on tiles whose rows are permuted (``PERMUTED``: the
# transposition's loads and stores on distinct banks, the shared pipe being the limit, 86 % busy): on an H100
# (lab.probes.fp8_dgrad_copier at f7a33bb; lab/results/finetune_h100/dgrad_forms_f7a33bb.txt) gate_up 4.80 ms
# against 5.55, down 2.57 against 2.93, the same bits with and without LoRA's term; the frozen MoE 16.47 / 16.63 ms
# against 17.02 / 17.22 (bf16 experts 21.58 / 21.67). Each alone gained less (PERMUTED 16.80 / 16.89, PAIRED none).
SPLIT_TRANSPOSITION = True
SPLIT_SETTINGS = dict(SPLIT=True, PAIRED=True, PERMUTED=True, MATH_REGS=184, PRODUCER_REGS=24, XPOSE_REGS=56)
_UPPER = gl.constexpr(0)  # the math warpgroups, by the 64 rows of a tile they own
_LOWER = gl.constexpr(1)


@gluon.constexpr_function
def words_layout(PERMUTED=False):
    """Register layout of a ``[128, 16]`` int32 piece of a weight tile (64 bytes of each of its 128 rows, the
    contraction, as copied) read for the transposition: a thread holds 16 rows of one word (rows 1-8 in its
    registers, row 16 by lane bit 0, the words by the other lanes, rows 32 and 64 by the warps); after the
    permutation 4 rows of 16 bytes, four 16-byte stores. In the 128-byte-swizzled tiles that makes both the loads and
    the stores 2-way bank-conflicting, where a plain blocked layout (whose reads ``ldmatrix`` takes) had its stores
    4-way: 535 against 458 TFLOP/s for the input gradient on the H200 (``lab/probes/fp8_gluon_xpose.py``, in git up to
    0b7a4de; a conflict-free mapping through linear shared layouts ran slower, 481: its addresses cost more than the
    conflicts).
    ``PERMUTED``: the rows are the copied tile's rows in shared memory, ``32 (r % 4) + r // 4`` for K row ``r``
    (:func:`permuted_w_desc`): a thread holds the same 16 K rows of one word, and a warp's lanes take words 0-7 and
    15-8 of two K rows 16 apart, whose swizzle phases differ by 4: no bank is read twice, and the stores of
    :func:`transpose_words` fall on 8 rows of distinct phases a quarter-warp."""
    if PERMUTED:
        return gl.DistributedLinearLayout(reg_bases=[[32, 0], [64, 0], [1, 0], [2, 0]],
                                          lane_bases=[[0, 1], [0, 2], [0, 4], [4, 0], [0, 8]],
                                          warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[128, 16])
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]],
                                      lane_bases=[[16, 0], [0, 1], [0, 2], [0, 4], [0, 8]],
                                      warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 16])


@gluon.jit
def _prmt(a, b, SEL: gl.constexpr):
    """``prmt.b32``: bytes of ``b:a`` (``a`` bytes 0-3, ``b`` 4-7) picked by the selector's nibbles, low first."""
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _words(tile):
    """An e4m3 ``[128, 128]`` tile in shared memory viewed as ``[128, 32]`` 4-byte words (the same swizzled bytes);
    ``reinterpret`` is ``_reinterpret`` before Triton 3.7."""
    W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    return (tile.reinterpret if hasattr(tile, "reinterpret") else tile._reinterpret)(gl.int32, [128, 32], W32)


@gluon.jit
def _byte_planes(w, PERMUTED: gl.constexpr = False):
    """:func:`_transposed_words` before its last reshape: ``o_c [32 g, 16 words]``, byte ``c`` of each word of 4 K
    rows ``4 g + i`` packed into one word. ``PERMUTED``: ``w``'s rows in :func:`words_layout`'s permuted order."""
    if PERMUTED:
        q = gl.reshape(gl.permute(gl.reshape(w, [4, 32, 16]), (1, 2, 0)), [32, 16, 2, 2])
    else:
        q = gl.reshape(gl.permute(gl.reshape(w, [32, 4, 16]), (0, 2, 1)), [32, 16, 2, 2])
    even, odd = gl.split(q)  # i bit 0
    r0, r2 = gl.split(even)
    r1, r3 = gl.split(odd)
    t0 = _prmt(r0, r1, "0x5140")  # r0 byte 0, r1 byte 0, r0 byte 1, r1 byte 1
    t1 = _prmt(r0, r1, "0x7362")  # bytes 2 and 3 likewise
    t2 = _prmt(r2, r3, "0x5140")
    t3 = _prmt(r2, r3, "0x7362")
    o0 = _prmt(t0, t2, "0x5410")  # byte 0 of rows 0-3: N = 4 word + 0
    o1 = _prmt(t0, t2, "0x7632")
    o2 = _prmt(t1, t3, "0x5410")
    o3 = _prmt(t1, t3, "0x7632")
    return o0, o1, o2, o3


@gluon.jit
def _transposed_words(w):
    """A ``[128 K, 16 words]`` piece of a weight tile (:func:`words_layout`: 64 bytes of each of 128 contraction rows)
    as ``[64 N, 32 K words]``: each 4 x 4 block of bytes (4 K rows of a word) transposed by 8 byte permutes (rows
    paired, then pairs of rows); a thread's 4 consecutive words of a row are then stored together (16 bytes). Left to
    the lowering (the bytes of ``gl.permute``) the same transposition took 96 ``PRMT`` a thread a tile against 64
    here; on an H100 at 780aa4a the frozen MoE ran 17.28 / 17.47 ms so against 17.82 / 17.79, the same bits
    (``lab/probes/fp8_xpose_words.py``)."""
    o0, o1, o2, o3 = _byte_planes(w)
    o = gl.join(gl.join(o0, o2), gl.join(o1, o3))  # [32 g, 16 word, 2 c bit 1, 2 c bit 0]: byte c of the word
    return gl.reshape(gl.permute(gl.reshape(o, [32, 16, 4]), (1, 2, 0)), [64, 32])  # [N = 4 word + c, K word g]


@gluon.jit
def transpose_words(raw, bt, PIECE: gl.constexpr, PERMUTED: gl.constexpr = False):
    """Columns ``[64 PIECE, 64 PIECE + 64)`` of the e4m3 tile ``raw [128 K, 128 N]`` into rows of ``bt [128 N, 128
    K]``, by 4-byte words (:func:`_transposed_words`). ``PERMUTED``: ``raw``'s rows in :func:`words_layout`'s
    permuted order, and ``bt``'s row of column ``N`` is ``32 (N % 4) + N // 4`` (the product's columns in that order:
    :func:`_natural_columns`)."""
    src, dst = _words(raw), _words(bt)
    if PERMUTED:
        o0, o1, o2, o3 = _byte_planes(src.slice(PIECE * 16, 16, dim=1).load(words_layout(True)), True)
        dst.slice(PIECE * 16, 16, dim=0).store(gl.permute(o0, (1, 0)))  # [16 words, 32 g]: N = 4 word + c
        dst.slice(32 + PIECE * 16, 16, dim=0).store(gl.permute(o1, (1, 0)))
        dst.slice(64 + PIECE * 16, 16, dim=0).store(gl.permute(o2, (1, 0)))
        dst.slice(96 + PIECE * 16, 16, dim=0).store(gl.permute(o3, (1, 0)))
    else:
        w = src.slice(PIECE * 16, 16, dim=1).load(words_layout())  # [128 K, 16 words]
        dst.slice(PIECE * 64, 64, dim=0).store(_transposed_words(w))


@gluon.jit
def _transpose_stage(j, raw, bt, land, ready, STAGES: gl.constexpr, FIRST: gl.constexpr, PIECES: gl.constexpr,
                     PERMUTED: gl.constexpr = False, STEPS: gl.constexpr = 1):
    """Step ``j``'s weight tile ``[BK, BN]`` (contraction-major, as copied) into its K-major buffer ``[BN, BK]``,
    through registers in 64-column pieces (``PIECES`` of them from piece ``FIRST``: both, or with ``SPLIT`` one a
    warpgroup); then one arrival on ``ready`` (the copy of its activation tile landed with the weight tile's, on
    ``land``). ``STEPS``: steps ``j, j + 1, ...`` so, behind one fence and one barrier (the fence waits for the
    warpgroup's stores to drain: ``PAIRED``'s two steps pay it once)."""
    for i in gl.static_range(STEPS):
        s = (j + i) % STAGES
        mbarrier.wait(land.index(s), ((j + i) // STAGES) & 1)
        for c in gl.static_range(FIRST, FIRST + PIECES):
            transpose_words(raw.index(s), bt.index(s), c, PERMUTED)
    fence_async_shared()
    _cta_sync()  # every thread's stores are in before the warpgroup's one arrival
    for i in gl.static_range(STEPS):
        mbarrier.arrive(ready.index((j + i) % STAGES), count=1)


@gluon.jit
def _producer(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, TRANS: gl.constexpr,
              E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr,
              LOW_RANK: gl.constexpr, SPLIT: gl.constexpr, PERMUTED: gl.constexpr = False):
    """Every TMA copy into the ring; with ``TRANS`` the weight tile's transposition too, unless ``SPLIT`` (two
    :func:`_transposer` take its halves)."""
    XPOSE: gl.constexpr = TRANS and not SPLIT
    a_smem, raw, bt, land, ready, empty = smem
    nk = KC // BK
    it = 0
    nt = 0  # tiles with a group: the low-rank buffers' turns
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            if LOW_RANK:
                _load_low_rank(low_rank, nt, row0, g * (tiles_n * BN) + pid_n * BN, PERMUTED)
                nt += 1
            for kb in range(nk):
                if XPOSE:
                    # the transposition first: it waits only for its copies, not for a free stage, so the ready
                    # stages run ahead of the math warpgroups
                    if it >= LAG:
                        _transpose_stage(it - LAG, raw, bt, land, ready, STAGES, 0, 2, PERMUTED)
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # the first pass over the ring: at once
                mbarrier.expect(land.index(s), BM * BK + BK * BN)  # e4m3: a byte each
                _tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                if PERMUTED:  # K rows r at 32 (r % 4) + r // 4 (permuted_w_desc)
                    _tma_load(w_desc, [0, (g * W_ROWS + kb * BK) // 4, pid_n * BN], land.index(s), raw.index(s))
                elif TRANS:
                    _tma_load(w_desc, [g * W_ROWS + kb * BK, pid_n * BN], land.index(s), raw.index(s))
                else:
                    _tma_load(w_desc, [g * W_ROWS + pid_n * BN, kb * BK], land.index(s), raw.index(s))
                it += 1
    if XPOSE:
        for j in range(gl.maximum(it - LAG, 0), it):
            _transpose_stage(j, raw, bt, land, ready, STAGES, 0, 2, PERMUTED)


@gluon.jit
def _transposer(table, KC, E, tiles_m, tiles_n, smem, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr, PIECE: gl.constexpr, PAIRED: gl.constexpr = False,
                PERMUTED: gl.constexpr = False):
    """A transposing warpgroup: 64 columns (``PIECE``) of every step's weight tile as it lands (the producer copied
    it once the stage was free, so its transposed buffer is free too). ``PAIRED``: two steps a fence
    (:func:`_transpose_stage`'s ``STEPS``)."""
    STEPS: gl.constexpr = 2 if PAIRED else 1
    a_smem, raw, bt, land, ready, empty = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            for _kb in range(nk // STEPS):
                _transpose_stage(it, raw, bt, land, ready, STAGES, PIECE, 1, PERMUTED, STEPS)
                it += STEPS
            if nk % STEPS == 1:  # PAIRED: the tile's odd last step alone
                _transpose_stage(it, raw, bt, land, ready, STAGES, PIECE, 1, PERMUTED)
                it += 1


@gluon.jit
def _scales(sa_ptrs, sw_ptr, rmask, kb, stride_sak, stride_sbk):
    """``sa * sw`` of contraction step ``kb`` for a math warpgroup's rows."""
    return gl.load(sa_ptrs + kb * stride_sak, mask=rmask, other=0.0) * gl.load(sw_ptr + kb * stride_sbk)


@gluon.jit
def _issue(a_smem, b_all, wait_on, zero, j, HALF: gl.constexpr, STAGES: gl.constexpr, WIDE: gl.constexpr = False):
    """Once stage ``j`` is ready, start its product into a fresh accumulator: this warpgroup's 64 rows of the tile
    by its 128 columns, or (``WIDE``, :mod:`.gluon_wide`'s ``[64, 256]`` tiles) the tile's 64 rows by this
    warpgroup's 128 columns."""
    s = j % STAGES
    mbarrier.wait(wait_on.index(s), (j // STAGES) & 1)
    if WIDE:
        return warpgroup_mma(a_smem.index(s), b_all.index(s).slice(HALF * 128, 128, dim=0).permute((1, 0)), zero,
                             use_acc=False, is_async=True)
    else:
        return warpgroup_mma(a_smem.index(s).slice(HALF * 64, 64, dim=0), b_all.index(s).permute((1, 0)), zero,
                             use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, tok, sc, empty, j, PENDING: gl.constexpr, STAGES: gl.constexpr):
    """Wait for step ``j``'s product (``PENDING`` later ones may still run), free its stage, add it times ``sc``."""
    part = warpgroup_mma_wait(PENDING, deps=[tok])
    mbarrier.arrive(empty.index(j % STAGES), count=1)
    # through an asm the compiler may not move: the additions stay ahead of the next product's start (else three
    # accumulators would be live and spill)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc + part * gl.expand_dims(sc, 1)],
                                     dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _natural_columns(acc):
    """A ``[64, 128]`` product whose column ``j`` is the tile's column ``4 (j % 32) + j // 32`` (``PERMUTED``'s
    transposed weight tile, :func:`transpose_words`) in the tile's order."""
    return gl.reshape(gl.permute(gl.reshape(acc, [64, 4, 32]), (0, 2, 1)), [64, 128])


@gluon.jit
def _store(out, acc, first_row, row_end, pid_n, stride_om, COALESCED: gl.constexpr, PERMUTED: gl.constexpr = False):
    """A math warpgroup's ``[64, BN]`` result, rows ``first_row + [0, 64)`` below ``row_end``, into ``out`` (its
    pointers made here, not held through the loop).
    ``COALESCED``: through shared memory (a layout conversion, 8 KB a warpgroup at a time) into 16-byte stores that
    fill whole 32-byte sectors, a warp's two rows at once; the accumulator's own layout stores 4 bytes a thread, half
    of each sector (Nsight Compute on an H100 at 0f10a59: 45 % of the forward's global sectors excess).
    ``PERMUTED``: ``acc``'s columns in :func:`transpose_words`' permuted order, put back first."""
    if PERMUTED:
        acc = _natural_columns(acc)
    if COALESCED:
        OUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        val = gl.convert_layout(acc.to(out.dtype.element_ty), OUT)
    else:
        val = acc.to(out.dtype.element_ty)
    rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, val.type.layout))
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, val.type.layout))
    ptrs = out + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    # the rows' bound only: the output's columns are a multiple of the tile's (``grouped.gluon_fits``), and a bound
    # that could change at any column would split the 16-byte stores into 2-byte ones
    gl.store(ptrs, val, mask=gl.expand_dims(rows < row_end, 1))


@gluon.jit
def _contract(acc, zero, a_smem, b_all, wait_on, empty, sa_ptrs, sw_ptr, rmask, it, nk, stride_sak, stride_sbk,
              HALF: gl.constexpr, STAGES: gl.constexpr, SIMPLE: gl.constexpr, WIDE: gl.constexpr):
    """A tile's contraction, ``nk`` steps from the ring's step ``it``, added into ``acc`` with the promotion (``sa *
    sw`` of each step for the warpgroup's rows). Four steps a round, each in its own accumulator registers, the
    product of the next step started before the last one is added in; no product runs across the loop's back edge
    (ptxas would copy its registers there and serialize the MMAs). ``SIMPLE``: every step waited for before its
    promotion. ``WIDE``: :func:`_issue`'s."""
    for r in range(0, 0 if SIMPLE else nk // 4):
        j = it + 4 * r
        sc0 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r, stride_sak, stride_sbk)
        t0 = _issue(a_smem, b_all, wait_on, zero, j, HALF, STAGES, WIDE)
        sc1 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 1, stride_sak, stride_sbk)
        t1 = _issue(a_smem, b_all, wait_on, zero, j + 1, HALF, STAGES, WIDE)
        acc = _promote(acc, t0, sc0, empty, j, 1, STAGES)
        sc2 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 2, stride_sak, stride_sbk)
        t2 = _issue(a_smem, b_all, wait_on, zero, j + 2, HALF, STAGES, WIDE)
        acc = _promote(acc, t1, sc1, empty, j + 1, 1, STAGES)
        sc3 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 3, stride_sak, stride_sbk)
        t3 = _issue(a_smem, b_all, wait_on, zero, j + 3, HALF, STAGES, WIDE)
        acc = _promote(acc, t2, sc2, empty, j + 2, 1, STAGES)
        acc = _promote(acc, t3, sc3, empty, j + 3, 0, STAGES)
    for kb in range(0 if SIMPLE else nk // 4 * 4, nk):
        sc0 = _scales(sa_ptrs, sw_ptr, rmask, kb, stride_sak, stride_sbk)
        t0 = _issue(a_smem, b_all, wait_on, zero, it + kb, HALF, STAGES, WIDE)
        acc = _promote(acc, t0, sc0, empty, it + kb, 0, STAGES)
    return acc


@gluon.jit
def _math(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
          stride_sbn, stride_om, smem, low_rank, HALF: gl.constexpr, TRANS: gl.constexpr, E_P2: gl.constexpr,
          GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOW_RANK: gl.constexpr, SIMPLE: gl.constexpr,
          COALESCED: gl.constexpr, PERMUTED: gl.constexpr = False):
    """Math warpgroup ``HALF``: rows ``[64 HALF, 64 HALF + 64)`` of each tile. ``SIMPLE``: one product in flight
    a warpgroup, waited for before its promotion (the other warpgroup's keeps the tensor cores busy meanwhile).
    ``COALESCED``: the result stored through shared memory (:func:`_store`)."""
    ACC: gl.constexpr = acc_layout()
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    a_smem, raw, bt, land, ready, empty = smem
    b_all = bt if TRANS else raw
    wait_on = ready if TRANS else land
    zero = gl.zeros([64, BN], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    nt = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        rows = row0 + HALF * 64 + gl.arange(0, 64, layout=ROWS)
        rmask = rows < row_end
        if g < E:
            sa_ptrs = sa + rows.to(gl.int64) * stride_sam
            sw_ptr = sw + g.to(gl.int64) * stride_swe + pid_n * stride_sbn
            # the low-rank term started in the accumulator: no second one at the end, where the registers are short
            acc, nt = _acc_start(low_rank, nt, zero, HALF, LOW_RANK, PERMUTED=PERMUTED)
            acc = _contract(acc, zero, a_smem, b_all, wait_on, empty, sa_ptrs, sw_ptr, rmask, it, nk, stride_sak,
                            stride_sbk, HALF, STAGES, SIMPLE, False)
            it += nk
            _store(out, acc, row0 + HALF * 64, row_end, pid_n, stride_om, COALESCED, PERMUTED)
        elif g == E:  # rows past offs[-1]
            _store(out, zero, row0 + HALF * 64, row_end, pid_n, stride_om, COALESCED)


@gluon.jit
def fp8_grouped_gluon_kernel(
    a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n,
    stride_sam, stride_sak, stride_swe, stride_sbk, stride_sbn, stride_om, v_desc, lw_desc, l_scale,
    TRANS: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr,
    MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LOW_RANK: gl.constexpr = False,
    SIMPLE: gl.constexpr = False, COALESCED: gl.constexpr = True, SPLIT: gl.constexpr = False,
    XPOSE_REGS: gl.constexpr = 0, PAIRED: gl.constexpr = False, PERMUTED: gl.constexpr = False,
):
    """``out[rows of e] = a[rows of e] @ B_e`` over ``[128, 128]`` tiles, ``B_e = W_e^T`` or (``TRANS``) ``W_e``;
    ``a_desc``: TMA descriptor of the e4m3 activations ``[M, KC]``, ``w_desc`` of the weights ``[E * W_ROWS, *]``
    (blocks ``[128, 128]``); ``sa [M, KC/128]`` and ``sw [E, ., .]`` their fp32 scales (strides ``sbk`` along the
    contraction, ``sbn`` along the output columns); ``table``: :func:`group_table`. ``LOW_RANK``: plus
    ``l_scale * v[rows of e] @ w_e^T``, ``v_desc`` of ``v [M, R]`` (blocks ``[128, R]``), ``lw_desc`` of ``w`` ``[E * N,
    R]`` (blocks ``[128, R]``), 16-bit, added in fp32 before the one rounding. ``SPLIT`` (``TRANS``): the
    transposition in two warpgroups of their own (``XPOSE_REGS`` registers each), the producer only copying;
    ``PAIRED``: two steps a fence in each; ``PERMUTED``: the weight tile copied with its rows permuted
    (:func:`permuted_w_desc`, the copied buffer ``[4, 32, BN]``) and the product's columns put back at the store."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], tile_smem())
    if PERMUTED:  # the copy of permuted_w_desc: [4 K rows mod 4, 32 K rows // 4, 128 N]
        raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 4, 32, BN], permuted_tile_smem())
    else:
        raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK, BN], tile_smem())
    if TRANS:  # the weight tile transposed (by the producer, or with SPLIT the transposers), beside the copied one
        bt = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], tile_smem())
    else:
        bt = raw
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)  # the expect; the copies' bytes
        mbarrier.init(empty.index(s), count=2)  # each math warpgroup, once its MMA on the stage is done
    if TRANS:  # the producer, once the weight tile is transposed
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=2 if SPLIT else 1)  # each transposing warpgroup
    else:  # no barrier made and left unused: the allocator could hand its bytes to a later buffer while they hold
        # an initialized barrier
        ready = land
    smem = (a_smem, raw, bt, land, ready, empty)
    low_rank = _low_rank_ring(v_desc, lw_desc, l_scale, a_smem, land, empty, LOW_RANK)
    # two literal lists: warp_specialize takes its (function, arguments) pairs written out (an argument tuple held in
    # a local, or a list joined with `+ ([...] if SPLIT else [])`, does not compile on Triton 3.6 / 3.9), and the
    # forward has no registers for a fourth partition
    if SPLIT:
        gl.warp_specialize([
            (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                     stride_sbk, stride_sbn, stride_om, smem, low_rank, _UPPER, TRANS, E_P2, GROUP_M, STAGES,
                     LOW_RANK, SIMPLE, COALESCED, PERMUTED)),
            (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                     stride_sbk, stride_sbn, stride_om, smem, low_rank, _LOWER, TRANS, E_P2, GROUP_M, STAGES,
                     LOW_RANK, SIMPLE, COALESCED, PERMUTED)),
            (_producer, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, TRANS,
                         E_P2, GROUP_M, STAGES, LAG, LOW_RANK, SPLIT, PERMUTED)),
            (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, 0, PAIRED, PERMUTED)),
            (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, 1, PAIRED, PERMUTED)),
        ], [4, 4, 4, 4], [MATH_REGS, PRODUCER_REGS, XPOSE_REGS, XPOSE_REGS])
    else:
        gl.warp_specialize([
            (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                     stride_sbk, stride_sbn, stride_om, smem, low_rank, _UPPER, TRANS, E_P2, GROUP_M, STAGES,
                     LOW_RANK, SIMPLE, COALESCED, PERMUTED)),
            (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                     stride_sbk, stride_sbn, stride_om, smem, low_rank, _LOWER, TRANS, E_P2, GROUP_M, STAGES,
                     LOW_RANK, SIMPLE, COALESCED, PERMUTED)),
            (_producer, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, low_rank, TRANS,
                         E_P2, GROUP_M, STAGES, LAG, LOW_RANK, SPLIT, PERMUTED)),
        ], [4, 4], [MATH_REGS, PRODUCER_REGS])


# Host side -------------------------------------------------------------------------------------------------------

def launch_settings(trans: bool, split: bool | None = None) -> dict:
    """The kernel's tuning constexprs: 4 stages (128 KB of tiles; 192 KB with the transposed buffers), the
    transposition ``LAG`` steps behind the copies (at most ``STAGES - 1``: a math warpgroup frees a stage only
    once the next one is ready, and the producer transposes before it waits for a free stage), and the registers
    of the math warpgroups and the producer (``setmaxnreg``; no spills at these, tests/ops/test_fp8_gluon_build.py
    builds with the Triton at hand). Where it transposes, the producer holds a 64-byte piece a thread: Triton 3.6
    (measured on the H200) needs 64 registers there and leaves the math warpgroups 224; 3.9 needs 232 for the math
    warpgroups and 48 for the producer.
    ``SIMPLE`` (the input gradient's default): a math warpgroup waits for each product before it promotes it, the
    other warpgroup's product running meanwhile; on an H100 at 8648eae the input gradients ran 3-8 % faster so
    (gate_up 6.31 / 6.18 ms against 6.55 / 6.37, down 3.16 / 3.19 against 3.44 / 3.38), the same bits; the forward
    ran slower so (725 against 757 TFLOP/s at gate_up) and keeps a product running while the last is promoted.
    ``COALESCED``: the result through shared memory into whole 32-byte sectors (its 8 KB of scratch a math warpgroup
    beside the stages); on an H100 at c228b90 the forwards ran gate_up 4.07 against 4.44 ms and down 2.34 against
    2.60, the input gradients 6.12 against 6.33 and 3.22 against 3.33, the frozen MoE 18.54 against 19.46.
    ``split``: the input gradient's transposition in two warpgroups of their own (:data:`SPLIT_SETTINGS`) or by the
    producer; None: :data:`SPLIT_TRANSPOSITION`. ``PAIRED`` (two steps a fence in each transposing warpgroup) and
    ``PERMUTED`` (the tiles' rows permuted so that the transposition's loads and stores hit distinct banks): on with
    the split, off without (the one transposer builds with ``PERMUTED`` too, unmeasured;
    ``lab/probes/fp8_dgrad_copier.py`` measures the split's forms)."""
    cfg = dict(GROUP_M=8, STAGES=4, LAG=2, COALESCED=True, SPLIT=False, XPOSE_REGS=0, PAIRED=False, PERMUTED=False)
    if not trans:
        return {**cfg, "MATH_REGS": 232, "PRODUCER_REGS": 40, "SIMPLE": False}
    math, producer = (224, 64) if triton_version() <= (3, 6) else (232, 48)
    cfg.update(MATH_REGS=math, PRODUCER_REGS=producer, SIMPLE=True)
    return {**cfg, **SPLIT_SETTINGS} if (SPLIT_TRANSPOSITION if split is None else split) else cfg


def grouped_mm_gluon(a: Tensor, a_scale: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool = False,
                     out_dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None,
                     settings: dict | None = None, low_rank: tuple[Tensor, Tensor, float] | None = None) -> Tensor:
    """The Gluon kernel on prepared operands, same contract as :func:`.triton.grouped_mm_triton` with ``a`` e4m3
    and its 1x128 scales; the weight's ``N`` and ``K`` multiples of 128 (``grouped.gluon_fits``). ``settings``:
    :func:`launch_settings` to override (measurements). ``low_rank``: ``(v [M, R], w [E, n_out, R], scale)``, one 16-bit
    dtype, ``R`` = :data:`RANK`: ``scale * v[rows of e] @ w[e]^T`` is added to the output before its rounding.
    ``a_scale`` ``[M, KC / 128]`` row-major, or the view of a ``[KC / 128, M]`` tensor (``quantize_1x128(...,
    scale_t=True)``), whose loads along a tile's rows are contiguous."""
    cfg = _settings(trans, settings)
    m, c = a.shape
    e, n_w, k_w = weight.shape
    n_out = k_w if trans else n_w
    a, a_scale, weight, scale, out = prepared(a, a_scale, weight, scale, out, n_out, out_dtype)
    if m == 0:
        return out
    walk = tile_walk(offs, m, n_out, BM.value, BN.value)
    a_desc, w_desc = tile_descs(a, weight, BM.value, 128)
    if cfg["PERMUTED"]:
        w_desc = permuted_w_desc(weight)
    if trans:  # contraction along W's rows
        ssk, ssn = scale.stride(1), scale.stride(2)
    else:
        ssk, ssn = scale.stride(2), scale.stride(1)
    v_desc, lw_desc, l_scale = (a_desc, a_desc, 0.0) if low_rank is None else low_rank_descs(
        *low_rank, m, e, n_out, permuted=cfg["PERMUTED"])
    fp8_grouped_gluon_kernel[walk.grid](
        a_desc, w_desc, a_scale, scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n,
        a_scale.stride(0), a_scale.stride(1), scale.stride(0), ssk, ssn, out.stride(0), v_desc, lw_desc, l_scale,
        TRANS=trans, E_P2=walk.e_p2, **cfg, LOW_RANK=low_rank is not None, num_warps=4)
    return out


def prepared(a: Tensor, a_scale: Tensor, weight: Tensor, scale: Tensor, out: Tensor | None, n_out: int,
             out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The launchers' operands: ``a``, the weights and their scales contiguous, the activation's scales row-major or
    the transposed view (the kernels read them by strides), and the output ``[M, n_out]`` (made where None)."""
    a = a.contiguous()
    if 1 not in a_scale.stride():
        a_scale = a_scale.contiguous()
    if out is None:
        out = torch.empty((a.shape[0], n_out), dtype=out_dtype, device=a.device)
    return a, a_scale, weight.contiguous(), scale.contiguous(), out


def tile_descs(a: Tensor, weight: Tensor, a_rows: int, w_rows: int) -> tuple:
    """TMA descriptors of the e4m3 activations ``a [M, C]`` (blocks ``[a_rows, 128]``) and the weights ``[E, R, C']``
    viewed ``[E R, C']`` (blocks ``[w_rows, 128]``), in the 128-byte-swizzled tile layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (m, c), (e, r, k) = a.shape, weight.shape
    return (TensorDescriptor(a, [m, c], [c, 1], [a_rows, BK.value], tile_smem()),
            TensorDescriptor(weight.view(e * r, k), [e * r, k], [k, 1], [w_rows, BK.value], tile_smem()))


def permuted_w_desc(weight: Tensor):
    """TMA descriptor of the weights ``[E, R, C]`` (``R`` a multiple of 4) whose ``[128, 128]`` tile lands with its K
    row ``r`` at row ``32 (r % 4) + r // 4``: the view ``[4, E R / 4, C]`` (strides ``C``, ``4 C``, 1), blocks
    ``[4, 32, 128]``, 128-byte swizzled (:func:`transpose_words`' ``PERMUTED``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    e, r, c = weight.shape
    return TensorDescriptor(weight, [4, e * r // 4, c], [c, 4 * c, 1], [4, 32, BK.value], permuted_tile_smem())


def _settings(trans: bool, settings: dict | None) -> dict:
    """:func:`launch_settings` with ``settings`` over them; a ``ValueError`` naming any setting the kernel has not."""
    cfg = launch_settings(trans)
    unknown = sorted(set(settings or {}) - set(cfg))
    if unknown:
        raise ValueError(f"settings: the kernel has no {unknown}; it takes {sorted(cfg)}")
    cfg = {**cfg, **(settings or {})}
    # only the input gradient transposes; PAIRED is its transposing warpgroups' (SPLIT)
    for name, needs_split in (("SPLIT", False), ("PERMUTED", False), ("PAIRED", True)):
        if cfg[name] and not (trans and (cfg["SPLIT"] or not needs_split)):
            raise ValueError(f"settings: {name} is a form of the input gradient's transposition (trans=True"
                             f"{', SPLIT=True' if needs_split else ''}); got trans={trans}, SPLIT={cfg['SPLIT']}")
    return cfg


def low_rank_descs(v: Tensor, w: Tensor, scale: float, m: int, e: int, n_out: int, v_rows: int = BM.value,
                   w_rows: int = BN.value, permuted: bool = False) -> tuple:
    """TMA descriptors of the low-rank term's ``v [M, R]`` and ``w [E, n_out, R]`` (blocks ``[v_rows, R]`` and
    ``[w_rows, R]``: a tile's rows and columns) and its scale; a ``ValueError`` unless they fit
    (:func:`low_rank_fits`). ``permuted``: ``w``'s rows as :func:`permuted_w_desc` lands the weight's (blocks ``[4,
    w_rows / 4, R]``), so that the term's columns come in the permuted tile's order."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not low_rank_fits(v, w) or v.shape[0] != m or tuple(w.shape[:2]) != (e, n_out) or v.device != w.device:
        raise ValueError(f"low_rank takes v [{m}, {RANK}] and w [{e}, {n_out}, {RANK}] of one 16-bit dtype, got v "
                         f"{v.dtype} {tuple(v.shape)}, w {w.dtype} {tuple(w.shape)}")
    r = v.shape[1]
    v, w = v.contiguous(), w.contiguous().view(e * n_out, r)
    gdt = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BM.value, r], gdt)  # 32-byte rows: the same for any row count
    if permuted:
        layout3 = gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=16, rank=3)
        w_desc = TensorDescriptor(w, [4, e * n_out // 4, r], [r, 4 * r, 1], [4, w_rows // 4, r], layout3)
    else:
        w_desc = TensorDescriptor(w, [e * n_out, r], [r, 1], [w_rows, r], layout)
    return TensorDescriptor(v, [m, r], [r, 1], [v_rows, r], layout), w_desc, float(scale)


def low_rank_fits(v: Tensor, w: Tensor) -> bool:
    """Whether the kernel takes the low-rank term of ``v [M, R]`` and ``w [E, N, R]``: one 16-bit dtype, ``R`` =
    :data:`RANK` (a lower rank is padded with zeros by the caller, a higher one added after the kernel: 32 would
    take the transposing kernel past the 227 KB of shared memory)."""
    return (v.dim() == 2 and w.dim() == 3 and v.dtype == w.dtype and v.dtype in (torch.bfloat16, torch.float16)
            and v.shape[1] == w.shape[2] == RANK)



"""Hopper sparse attention forward written in Gluon (Triton's explicit-layout dialect), "seesaw" schedule.

Same contract and math as ``sparse_attn_fwd_kernel`` in ``triton.py`` (README.md); this kernel exists for speed
on sm_90. Three warp-specialized partitions: two math sides that own alternate 64-key tiles of a row (side 0 the
even tiles, in key slot 0; side 1 the odd ones, slot 1) and a producer warpgroup that does every copy.

- Each side computes its whole ``[64, 64]`` score tile over d (m64n64 products with q and the keys in shared
  memory); ``O`` is split by columns (side 0 ``[:, :d/2]``, side 1 ``[:, d/2:]``): each side multiplies its own
  ``P`` from registers into its column half (RS) and the other side's ``P`` from shared memory (SS).
- The online-softmax maximum runs along a chain, side 0 -> side 1 -> side 0 per pair of tiles, through 256-byte
  buffers, so one side's softmax runs while the other side's products hold the tensor cores; no CTA-wide barrier
  in the loop (mbarriers, one producer and one consumer each). Row sums stay per side until the item ends.
- The producer refills each key slot in halves, each as soon as its last reader is done: the half a slot's owner
  reads in its own ``P V`` after that product, the other half after the other side's ``P V`` has read it; the
  next score product starts on the half that lands first. q, two 64-key slots and two ``P`` buffers: 209 KB at
  d = 512 (a third slot does not fit; the halves are what let two slots hold the two tiles in flight and still
  prefetch).
- A program loops over (row, 64-head) items (one program an SM) and everything runs on across
  items: the producer loads the next item's q as soon as both sides' last score products of this item are done,
  and the next item's first pair of key tiles as the slots free up; the per-pair barriers' phases count pairs
  over the whole program.
- Each side stores its half of ``o`` from registers after one in-warp swap (8-byte row pieces; from the MMA layout
  they were 4-byte pieces, half a sector each).

The schedule is FlashMLA's SM90 sparse prefill's (lab/peers/flashmla_sm90_sparse_fwd.md); it is faster than a
lockstep build (both warpgroups on every tile, CTA barriers between the products) and about twice the Triton
kernel (BENCHMARKS.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["sparse_attn_fwd_gluon_kernel"]

# The cp.async builtin was renamed (Triton 3.6: async_copy_global_to_shared, later: async_load).
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.constexpr_function
def mma_layout(n, warpgroups):
    """Warpgroup-MMA register layout of a ``[64, warpgroups * n]`` tile, split by columns between the warpgroups
    (each holds a ``[64, n]`` accumulator)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warpgroups], instr_shape=[16, n, 16])


@gluon.constexpr_function
def row_layout(warps=8):
    """Row tiles (key gathers, the q / dO loads): 16 bytes per thread along d, one cp.async each."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[warps, 1],
                            order=[1, 0])


@gluon.constexpr_function
def mma_smem(row_bytes):
    """Shared-memory layout of a 16-bit MMA operand whose rows are ``row_bytes`` long."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(row_bytes, 128), element_bitwidth=16, rank=2)


@gluon.constexpr_function
def scan_layout(n):
    """A ``[n]`` layout that every warp of a 4-warp partition holds whole (the warps repeat it), ``n / 32``
    contiguous ids a thread: a reduction over it stays within each warp (shuffles, no shared memory, which the
    kernels have none of to spare)."""
    per = n // 32
    return gl.DistributedLinearLayout(reg_bases=[[1 << b] for b in range(per.bit_length() - 1)],
                                      lane_bases=[[per << b] for b in range(5)], warp_bases=[[0], [0]],
                                      block_bases=[], shape=[n])


@gluon.jit
def _low_ids(idx_row, offs, n_keys):
    """The ids at ``offs`` of a row's list (-1 at and past ``n_keys``), for their sign only: an int64 list is read
    as its low 32-bit words (little-endian; -1 stays -1 and kv rows are far below 2^31), so the ids a thread holds
    take one register each instead of two, which keeps the forward's math sides free of spills."""
    if idx_row.dtype.element_ty == gl.int64:
        low = gl.load(idx_row.to(gl.pointer_type(gl.int32)) + 2 * offs, mask=offs < n_keys, other=-1)
    else:
        low = gl.load(idx_row + offs, mask=offs < n_keys, other=-1)
    return low


@gluon.jit
def _key_count(idx_row, n_keys, SCAN: gl.constexpr):
    """1 + the position of the last id >= 0 among the row's first ``n_keys`` (0 if there is none), read from the
    end ``SCAN`` ids at a time: a row's valid ids usually reach into its last ``SCAN``, so one read."""
    offs0 = gl.arange(0, SCAN, layout=scan_layout(SCAN))
    last = n_keys * 0
    c = gl.cdiv(n_keys, SCAN)
    while (last == 0) & (c > 0):
        c -= 1
        offs = c * SCAN + offs0
        last = gl.max(gl.where(_low_ids(idx_row, offs, n_keys) >= 0, offs + 1, 0), axis=0)
    return last


@gluon.jit
def row_keys(idx, topk_len, t, stride_it, K, BK: gl.constexpr, HAS_LEN: gl.constexpr):
    """Row ``t``'s index list, its key count (``topk_len`` limits it when given) and its number of key tiles.
    The count ends at the row's last valid id, so the tiles of ``-1`` after it are not run (they add nothing:
    rows whose selection is not full, such as a document's first ``k * ratio`` rows, padding rows, HCA's
    ranges)."""
    idx_row = idx + t * stride_it
    n_keys = K
    if HAS_LEN:
        n_keys = gl.minimum(gl.load(topk_len + t).to(gl.int32), K)
    n_keys = _key_count(idx_row, n_keys, 512)
    return idx_row, n_keys, gl.cdiv(n_keys, BK)


@gluon.jit
def tile_ids(idx_row, start, n_keys, BK: gl.constexpr, layout: gl.constexpr):
    offs = start + gl.arange(0, BK, layout=layout)
    return gl.load(idx_row + offs, mask=offs < n_keys, other=-1)


# mbarriers, by index
_Q = gl.constexpr(0)  # q landed (the producer's copies)
_READY = gl.constexpr(1)  # + 2 * slot + half: that half of the slot landed (the producer's copies)
_FREE = gl.constexpr(5)  # + 2 * slot + half: its last reader is done with that half of the slot
_MX = gl.constexpr(9)  # + side: that side's running maximum is in its buffer
_P_FULL = gl.constexpr(11)  # + side: that side's P is in its buffer
_P_EMPTY = gl.constexpr(13)  # + side: the other side is done with that side's P buffer
_L = gl.constexpr(15)  # + side: that side's row sum is in its buffer
_Q_FREE = gl.constexpr(17)  # both sides' last score products of an item are done (one arrival each)
_N_BARS = gl.constexpr(18)
_EVEN = gl.constexpr(0)  # the sides
_ODD = gl.constexpr(1)


@gluon.jit
def _gather_half(kv, ids, stride_kvn, slot, HALF_I: gl.constexpr, bar, BD: gl.constexpr):
    """cp.async columns ``[HALF_I * d/2, (HALF_I + 1) * d/2)`` of the key rows ``ids`` (-1: none, zero-filled)
    into ``slot``, then arrive on ``bar`` once they land (every producer thread arrives: the barrier counts 128)."""
    ROWS: gl.constexpr = row_layout(4)
    offs_d = HALF_I * (BD // 2) + gl.arange(0, BD // 2, layout=gl.SliceLayout(0, ROWS))
    ptrs = gl.expand_dims(kv + ids.to(gl.int64) * stride_kvn, 1) + gl.expand_dims(offs_d, 0)
    _cp_async(slot.slice(HALF_I * (BD // 2), BD // 2, dim=1), ptrs, mask=gl.expand_dims(ids >= 0, 1))
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.constexpr_function
def row_piece_layout(n):
    """Register layout of a warpgroup's ``[64, n]`` MMA result for global stores or reductions: the MMA layout
    with one lane bit and one register bit swapped, so that each thread holds 4 contiguous columns (8 bytes, or
    one ``v4`` of fp32) instead of pairs and a quad of lanes a whole 32-byte sector of a row. The change is one
    transposition within each warp (shuffles: no shared memory is free at d = 512; the compiler takes at most one
    such swap without going through shared memory). From the MMA layout the pieces are 4 bytes, half a sector."""
    col_regs = [[0, 1 << b] for b in range(4, n.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + col_regs,
        lane_bases=[[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, n])


@gluon.jit
def store_half(dst, t, h0, stride_t, stride_h, half, HALF_I: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr):
    """Store a warpgroup's ``[BH, d/2]`` half (columns from ``HALF_I * d/2``) of row ``t``'s block of heads
    ``h0..`` (o in the forward, dq in the backward) after one in-warp swap to 8-byte row pieces
    (``row_piece_layout``); from the MMA layout they are 4-byte pieces, half a sector each."""
    ST_L: gl.constexpr = row_piece_layout(BD // 2)
    vals = gl.convert_layout(half, ST_L)
    offs_h = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ST_L))
    offs_d = HALF_I * (BD // 2) + gl.arange(0, BD // 2, layout=gl.SliceLayout(0, ST_L))
    gl.store(dst + t * stride_t + gl.expand_dims(offs_h, 1) * stride_h + gl.expand_dims(offs_d, 0), vals)


@gluon.jit
def _load_q(q, t, h0, stride_qt, stride_qh, buf, bar, BH: gl.constexpr, BD: gl.constexpr):
    """cp.async row ``t``'s ``[BH, d]`` query block (heads from ``h0``) into ``buf``; arrive on ``bar`` once it
    lands (the producer's 128 threads)."""
    offs_h = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, row_layout(4)))
    offs_d = gl.arange(0, BD, layout=gl.SliceLayout(0, row_layout(4)))
    _cp_async(buf, q + t * stride_qt + gl.expand_dims(offs_h.to(gl.int64) * stride_qh, 1) + gl.expand_dims(offs_d, 0))
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def keys_valid(idx_row, start, n_keys, BK: gl.constexpr, layout: gl.constexpr):
    """Whether each key of the tile at ``start`` exists (index >= 0, within the row's count)."""
    return _low_ids(idx_row, start + gl.arange(0, BK, layout=layout), n_keys) >= 0


@gluon.jit
def _producer(
    q, kv, idx, topk_len, stride_qt, stride_qh, stride_kvn, stride_it, K, n_work, n_hb, smem,
    HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
):
    """Every copy: each item's q once both sides' score products of the item before are done, then per pair of
    key tiles the four slot halves in the order their last readers finish (a free barrier's first wait, on the
    phase before the first, passes at once)."""
    ROW_I: gl.constexpr = gl.SliceLayout(1, row_layout(4))
    k_all, q_all, p_all, mx_all, l_all, bars = smem
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    g = 0  # pairs issued
    c = 0  # items with keys issued
    for w in range(pid, n_work, n_prog):
        t = (w // n_hb).to(gl.int64)
        idx_row, n_keys, n_tiles = row_keys(idx, topk_len, t, stride_it, K, BK, HAS_LEN)
        n_pairs = gl.cdiv(n_tiles, 2)
        if n_pairs > 0:
            mbarrier.wait(bars.index(_Q_FREE), (c & 1) ^ 1)
            _load_q(q, t, (w % n_hb) * BH, stride_qt, stride_qh, q_all.index(0), bars.index(_Q), BH, BD)
            c += 1
        for j in range(n_pairs):
            ph = ((g + j) & 1) ^ 1
            # the pair's index lists first, so their latency is behind the waits
            ids0 = tile_ids(idx_row, 2 * j * BK, n_keys, BK, ROW_I)
            ids1 = tile_ids(idx_row, (2 * j + 1) * BK, n_keys, BK, ROW_I)
            k0 = k_all.index(0)
            k1 = k_all.index(1)
            # slot 0's half 0 after side 0's own P V, slot 1's half 1 after side 1's, then the halves the other
            # side's P V reads
            mbarrier.wait(bars.index(_FREE + 0), ph)
            _gather_half(kv, ids0, stride_kvn, k0, 0, bars.index(_READY + 0), BD)
            mbarrier.wait(bars.index(_FREE + 3), ph)
            _gather_half(kv, ids1, stride_kvn, k1, 1, bars.index(_READY + 3), BD)
            mbarrier.wait(bars.index(_FREE + 1), ph)
            _gather_half(kv, ids0, stride_kvn, k0, 1, bars.index(_READY + 1), BD)
            mbarrier.wait(bars.index(_FREE + 2), ph)
            _gather_half(kv, ids1, stride_kvn, k1, 0, bars.index(_READY + 2), BD)
        g += n_pairs


@gluon.jit
def _publish(buf, val, bar):
    """Write ``val`` into ``buf`` for the other side and arrive on ``bar`` (one writer, one reader)."""
    buf.store(val)
    fence_async_shared()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _online_step(s, m_run, l_run, m_new):
    """One online-softmax step onto the maximum ``m_new`` (base 2): ``P``, the factor ``alpha`` the running sums
    take, and the updated row sum."""
    alpha = gl.exp2(m_run - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    return p, alpha, l_run * alpha + gl.sum(p, axis=1)


@gluon.jit
def _scale_rows(acc, f, O_L: gl.constexpr):
    """``acc * f[:, None]`` for a row vector ``f`` in the score layout and ``acc`` in ``O_L``."""
    return acc * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, O_L)), 1)


@gluon.jit
def _side(
    kv, idx, topk_len, sink, o, lse,
    stride_it, stride_ot, stride_oh, stride_lt,
    K, qk_scale_log2, n_work, n_hb,
    smem,
    SIDE: gl.constexpr, HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
):
    S_L: gl.constexpr = mma_layout(BK, 1)
    O_L: gl.constexpr = mma_layout(BD // 2, 1)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_V: gl.constexpr = gl.SliceLayout(1, S_L)
    HALF: gl.constexpr = BD // 2
    OWN: gl.constexpr = SIDE  # the column half this side accumulates and reads in its own P V
    OTHER: gl.constexpr = 1 - SIDE
    dtype: gl.constexpr = kv.dtype.element_ty
    k_all, q_all, p_all, mx_all, l_all, bars = smem
    mx_mine = mx_all.index(SIDE)
    mx_theirs = mx_all.index(OTHER)
    s_zero = gl.zeros([BH, BK], gl.float32, layout=S_L)

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    # The sides and the producer walk the same items and count the same pairs, so each barrier's phase is a
    # shared count: the per-pair barriers complete once a pair (gp), _Q, _Q_FREE and _L once an item with keys (gi).
    gp = 0
    gi = 0
    for w in range(pid, n_work, n_prog):
        t = (w // n_hb).to(gl.int64)
        h0 = (w % n_hb) * BH
        idx_row, n_keys, n_tiles = row_keys(idx, topk_len, t, stride_it, K, BK, HAS_LEN)
        n_pairs = gl.cdiv(n_tiles, 2)
        offs_hs = h0 + gl.arange(0, BH, layout=ROW_V)
        # The sink is the softmax's starting state (max = sink, sum = 1), its 1 counted on side 0 only.
        m_run = gl.load(sink + offs_hs).to(gl.float32) * 1.4426950408889634
        l_run = gl.full([BH], 1.0 - SIDE, gl.float32, layout=ROW_V)
        acc = gl.zeros([BH, HALF], gl.float32, layout=O_L)
        if n_pairs > 0:
            mbarrier.wait(bars.index(_Q), gi & 1)

        for j in range(n_pairs):
            ph = (gp + j) & 1
            tile = 2 * j + SIDE
            # The MMAs' shared-memory operands through an index the compiler cannot fold (as in gluon_bwd.py):
            # otherwise it hoists their descriptors out of the loop and spills them.
            z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)
            q_smem = q_all.index(z)
            my_slot = k_all.index(z + SIDE)
            other_slot = k_all.index(z + OTHER)
            p_mine = p_all.index(z + SIDE)
            p_theirs = p_all.index(z + OTHER)
            # S = q K^T over this side's tile, the half of d the producer fills first (the own half) first
            mbarrier.wait(bars.index(_READY + 2 * SIDE + OWN), ph)
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem.slice(OWN * HALF, HALF, dim=1),
                                  my_slot.slice(OWN * HALF, HALF, dim=1).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(bars.index(_READY + 2 * SIDE + OTHER), ph)
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem.slice(OTHER * HALF, HALF, dim=1),
                                  my_slot.slice(OTHER * HALF, HALF, dim=1).permute((1, 0)), s_tok, is_async=True)
            valid = keys_valid(idx_row, tile * BK, n_keys, BK, gl.SliceLayout(0, S_L))
            s = warpgroup_mma_wait(0, deps=[s_tok])
            if j + 1 == n_pairs:
                # this item's last score product: once both sides' are done, q's buffer takes the next item's q
                mbarrier.arrive(bars.index(_Q_FREE), count=1)
            s = s * qk_scale_log2 + gl.expand_dims(gl.where(valid, 0.0, float("-inf")), 0)
            v_mine = my_slot.slice(OWN * HALF, HALF, dim=1)  # this tile's V, this side's columns
            if SIDE == 0:
                # Publish max(m_run, this tile's max), then P V into this side's columns under the other side's
                # softmax; rescale to the pair's maximum once it comes back.
                m_e = gl.maximum(m_run, gl.max(s, axis=1))
                _publish(mx_mine, m_e, bars.index(_MX + SIDE))
                p, alpha, l_run = _online_step(s, m_run, l_run, m_e)
                acc = _scale_rows(acc, alpha, O_L)
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), A_L), v_mine, acc, is_async=True)
                mbarrier.wait(bars.index(_MX + OTHER), ph)
                m_pair = mx_theirs.load(ROW_V)
                c = gl.exp2(m_e - m_pair)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(bars.index(_FREE + 2 * SIDE + OWN), count=1)
                acc = _scale_rows(acc, c, O_L)
                l_run = l_run * c
                p_out = (p * gl.expand_dims(c, 1)).to(dtype)
                mbarrier.wait(bars.index(_P_EMPTY + SIDE), ph ^ 1)
                _publish(p_mine, p_out, bars.index(_P_FULL + SIDE))
            else:
                mbarrier.wait(bars.index(_MX + OTHER), ph)
                m_pair = gl.maximum(mx_theirs.load(ROW_V), gl.max(s, axis=1))
                _publish(mx_mine, m_pair, bars.index(_MX + SIDE))
                p, alpha, l_run = _online_step(s, m_run, l_run, m_pair)
                p16 = p.to(dtype)
                mbarrier.wait(bars.index(_P_EMPTY + SIDE), ph ^ 1)
                _publish(p_mine, p16, bars.index(_P_FULL + SIDE))
                acc = _scale_rows(acc, alpha, O_L)
                acc = warpgroup_mma(gl.convert_layout(p16, A_L), v_mine, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(bars.index(_FREE + 2 * SIDE + OWN), count=1)
            # The other side's P against the other side's tile, this side's columns: then that half of the other
            # side's slot and the other side's P buffer are free.
            mbarrier.wait(bars.index(_P_FULL + OTHER), ph)
            fence_async_shared()
            acc = warpgroup_mma(p_theirs, other_slot.slice(OWN * HALF, HALF, dim=1), acc)
            mbarrier.arrive(bars.index(_P_EMPTY + OTHER), count=1)
            mbarrier.arrive(bars.index(_FREE + 2 * OTHER + OWN), count=1)
            m_run = m_pair

        if n_pairs > 0:
            # The row sum is split between the sides: exchange the two halves.
            _publish(l_all.index(SIDE), l_run, bars.index(_L + SIDE))
            mbarrier.wait(bars.index(_L + OTHER), gi & 1)
            l_i = l_run + l_all.index(OTHER).load(ROW_V)
            gi += 1
        else:
            # No keys: o = 0 and lse = sink; the sides agree without an exchange (and skipping it keeps the
            # exchange buffers' one-writer-one-reader order: every exchanged item has a pair between).
            l_i = gl.full([BH], 1.0, gl.float32, layout=ROW_V)
        gp += n_pairs
        # One reciprocal a row instead of a division an element.
        out = _scale_rows(acc, 1.0 / l_i, O_L)
        store_half(o, t, h0, stride_ot, stride_oh, out.to(dtype), OWN, BH, BD)
        if SIDE == 0:
            gl.store(lse + t * stride_lt + offs_hs, m_run * 0.6931471805599453 + gl.log(l_i))


@gluon.jit
def sparse_attn_fwd_gluon_kernel(
    q, kv, idx, topk_len, sink, o, lse,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    K, qk_scale_log2, n_work, n_hb,
    HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
    SIDE1_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = q.dtype.element_ty
    k_all = gl.allocate_shared_memory(dtype, [2, BK, BD], mma_smem(BD * 2))
    q_all = gl.allocate_shared_memory(dtype, [1, BH, BD], mma_smem(BD * 2))
    p_all = gl.allocate_shared_memory(dtype, [2, BH, BK], mma_smem(BK * 2))
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    mx_all = gl.allocate_shared_memory(gl.float32, [2, BH], vec_sl)
    l_all = gl.allocate_shared_memory(gl.float32, [2, BH], vec_sl)
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_Q), count=128)
    for b in gl.static_range(4):
        mbarrier.init(bars.index(_READY + b), count=128)  # every producer thread arrives (cp.async)
        mbarrier.init(bars.index(_FREE + b), count=1)
    for s in gl.static_range(2):
        mbarrier.init(bars.index(_MX + s), count=1)
        mbarrier.init(bars.index(_P_FULL + s), count=1)
        mbarrier.init(bars.index(_P_EMPTY + s), count=1)
        mbarrier.init(bars.index(_L + s), count=1)
    mbarrier.init(bars.index(_Q_FREE), count=2)
    smem = (k_all, q_all, p_all, mx_all, l_all, bars)
    gl.warp_specialize([
        (_side, (kv, idx, topk_len, sink, o, lse, stride_it, stride_ot, stride_oh, stride_lt, K, qk_scale_log2,
                 n_work, n_hb, smem, _EVEN, HAS_LEN, BH, BD, BK)),
        (_side, (kv, idx, topk_len, sink, o, lse, stride_it, stride_ot, stride_oh, stride_lt, K, qk_scale_log2,
                 n_work, n_hb, smem, _ODD, HAS_LEN, BH, BD, BK)),
        (_producer, (q, kv, idx, topk_len, stride_qt, stride_qh, stride_kvn, stride_it, K, n_work, n_hb, smem,
                     HAS_LEN, BH, BD, BK)),
    ], [4, 4], [SIDE1_REGS, PRODUCER_REGS])

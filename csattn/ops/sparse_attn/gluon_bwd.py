"""Hopper sparse attention backward in one warp-specialized Gluon kernel: ``dq``, ``dkv`` and the per-row
``dsink`` terms.

Same contract and math as the Triton pair ``sparse_attn_bwd_kernel_dq`` + ``sparse_attn_bwd_kernel_dkv`` in
``triton.py`` (README.md). A work item is one query row x 64 heads; a program loops over items (persistent: one
program an SM, so an item's row terms and first gather run under the last chunks of the item
before). Its two warpgroups have one job each and run out of phase, handing work over through shared memory and
mbarriers:

- the *score* warpgroup (the default partition) gathers each 64-key tile (``cp.async``), computes
  ``S = Q K^T`` and ``dP = dO K^T`` whole (m64n64, K = d), then ``P`` and ``scale dS``, writes both to shared
  memory and adds ``dS K`` into the left half of ``dq`` with ``dS`` straight from registers (A operand);
- the *key* warpgroup (a worker partition) adds ``dS K`` into the right half of ``dq`` from shared memory, then
  computes the key-side tile ``P^T dO + (scale dS)^T Q`` in 64-column chunks, two chunks in flight on the tensor
  cores while the previous chunk's fp32 reductions into ``dkv`` go out as whole-line ``red.v4`` (``red_rows``).
  ``dkv`` keeps each 64-column chunk in the order the MMA registers already have (``_stored_columns``), so the
  reductions need one lane / register trade instead of two; the host puts the columns back (``triton.dkv_columns``,
  one pass over the fp32 sums, which the cast to kv's dtype made anyway).

Barriers: ``kv_full`` (the tile's copies landed: one ``cp.async`` arrive per score thread; an item's first phase
also covers its q and dO copies), ``kv_empty`` (both halves of ``dS K`` are done with the tile, so the next gather
starts while the key warpgroup is still on its chunks), ``pds_full`` / ``pds_empty`` (two ``P`` / ``dS`` slots
used by turns, so the score warpgroup writes tile i + 1's while the key warpgroup reads tile i's), ``qdo_free``
(four, one per 128 columns: the key warpgroup's last chunks over those columns of an item's last tile are done,
so the next item's q and dO come in piece by piece under its remaining chunks). One key slot: 230 KB of shared
memory at d = 512. ``dkv`` is not bitwise reproducible run to run (atomics); dq and dsink are.
With ``FIXED`` (deterministic mode, ``red_rows``) it sums ``dkv`` in exact int64 fixed point instead, the same bits
run to run.

BENCHMARKS.md has it beside cuDNN Frontend's SM90 kernel.
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

from .gluon_fwd import _cp_async, keys_valid, mma_layout, mma_smem, row_keys, row_layout, store_half, tile_ids

__all__ = ["sparse_attn_bwd_gluon_kernel"]

# q and dO of the next item come in this many columns at a time, each piece once the key warpgroup's last chunks
# over it are done
_QDO_COLS = gl.constexpr(128)


@gluon.constexpr_function
def red_layout():
    """Register layout of a ``[64, 64]`` fp32 key-side tile in stored column order (see ``_stored_columns``)
    for its reductions into ``dkv``: each thread holds 4 adjacent columns in consecutive registers (one
    ``red.v4``). The MMA layout's own registers renamed would make a warp instruction cover 8 rows x 64 bytes;
    this one trades one lane bit (a row) for one register bit (a column) by warp shuffles, for 4 rows x 128
    bytes (whole L2 lines; lab/NOTES.md has the half-line variant's numbers)."""
    reg, lane = [[0, 1], [0, 2], [8, 0], [1, 0], [0, 32]], [[0, 4], [0, 8], [0, 16], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[16, 0], [32, 0]],
                                      block_bases=[], shape=[64, 64])


@gluon.jit
def _stored_columns(tile):
    """The ``[64, 64]`` MMA-layout tile with its columns in the order ``dkv`` keeps them (``triton.dkv_columns``):
    stored column ``f`` holds column ``(f & 49) | (f & 2) << 2 | (f & 12) >> 1``. No data moves: in the MMA
    layout a thread's registers hold columns ``{0, 1} + 8 j`` of its quad's ``2 a``, and in this order they
    are ``4 j' + {0, 1, 2, 3}``, i.e. whole ``red.v4`` pieces, without the two lane / register trades (768
    selects and 260 shuffles a tile and warp) the true order needs."""
    x = gl.reshape(tile, [64, 2, 2, 2, 2, 2, 2])  # column bits 32, 16, 8, 4, 2, 1
    x = gl.permute(x, (0, 1, 2, 4, 5, 3, 6))  # bit 8 becomes bit 2; bits 4, 2 become 8, 4
    return gl.reshape(x, [64, 64])


@gluon.constexpr_function
def _red_v4_asm(byte_offset):
    """One predicated whole-vector fp32 reduction at ``[$4 + byte_offset]`` (4 values a thread, ``pack=4``), no
    result. ``gl.atomic_add`` (Triton 3.6) writes an ``atom`` whose address is computed again for every chunk; here a
    chunk's offset from the tile's row pointers is an immediate (fewer instructions and spills)."""
    return ("{ .reg .pred p; setp.ne.b32 p, $12, 0; "
            f"@p red.global.gpu.relaxed.add.v4.f32 [$4+{byte_offset}], {{$8, $9, $10, $11}}; "
            "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")


@gluon.constexpr_function
def _red_s64_asm(byte_offset):
    """``FIXED``: one pack of 4 scaled fp32 values (``pack=4``), each rounded to the nearest integer (``cvt.rni``,
    ties to even; NaN gives 0, out of range saturates) and added by a predicated relaxed ``red.add.u64`` (two's
    complement: exact for signed values too) at ``[$4 + byte_offset + 64 j]``, ``j`` the value's place in the pack
    (``red_rows`` interleaves a half's columns 8 places apart); no result. There is no vector integer ``red``, so a
    pack is four of them."""
    reds = " ".join(f"@p red.global.gpu.relaxed.add.u64 [$4+{byte_offset + 64 * j}], fxr{j};" for j in range(4))
    return ("{ .reg .pred p; .reg .b64 fxr0, fxr1, fxr2, fxr3; setp.ne.b32 p, $12, 0; "
            "cvt.rni.s64.f32 fxr0, $8; cvt.rni.s64.f32 fxr1, $9; cvt.rni.s64.f32 fxr2, $10; "
            f"cvt.rni.s64.f32 fxr3, $11; {reds} "
            "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")


@gluon.jit
def red_rows(dkv, ids, tile, col0, BD: gl.constexpr, FIXED: gl.constexpr = False, fx_scale=1.0):
    """``dkv[ids[r], col0 + f] += tile[r, c(f)]`` for a ``[64, 64]`` MMA-layout tile, ``c(f)`` the stored
    column order of ``_stored_columns`` (fp32 relaxed reductions, ``-1`` ids skipped). ``col0`` is a
    compile-time column; the row pointers do not depend on it, so a tile's chunks share them.

    In true column order a warp's reduction from the MMA layout adds 8 rows x 32 bytes, which L2 serves as 8
    one-sector requests, and that request rate bounded the kernel; two trades make them whole lines (faster,
    though the key warpgroup spends more than half its instructions on them).

    ``FIXED`` (deterministic mode): ``dkv`` is int64 and each value goes in as ``round(x * fx_scale)``
    (``fx_scale = 2**e``, ``fixed_point.py``) by ``red.add.u64``, four a pack. The 32 columns of each half are
    interleaved, stored place ``(f & 3) * 8 + (f >> 2)`` for half column ``f`` (``triton._fixed_stored`` undoes
    it), so that one warp instruction (one place of every pack) adds 64 contiguous bytes a row; a pack's values at
    adjacent 8-byte places instead add 8 bytes in each of 8 sectors (about 3x slower on the H200)."""
    layout: gl.constexpr = red_layout()
    vals = gl.convert_layout(_stored_columns(tile), layout)
    # the two 32-column halves (a register bit in this layout) share row pointers, +128 bytes as an immediate
    lo, hi = gl.split(gl.permute(gl.reshape(vals, [64, 2, 32]), (0, 2, 1)))
    half: gl.constexpr = lo.type.layout
    ids_r = gl.convert_layout(ids, gl.SliceLayout(1, half))
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, half))
    if FIXED:
        cols = (cols & 3) * 8 + (cols >> 2)
    ptrs = (gl.expand_dims(dkv + ids_r.to(gl.int64) * BD, 1) + gl.expand_dims(cols, 0)).to(gl.int64)
    valid = gl.expand_dims((ids_r >= 0).to(gl.int32), 1) + gl.zeros([64, 32], gl.int32, half)
    if FIXED:
        # 8-byte elements: a chunk's offset and the hi half's are twice the fp32 ones
        _red_s64(ptrs, lo * fx_scale, valid, col0 * 8)
        _red_s64(ptrs, hi * fx_scale, valid, col0 * 8 + 256)
    else:
        _red_v4(ptrs, lo, valid, col0 * 4)
        _red_v4(ptrs, hi, valid, col0 * 4 + 128)


@gluon.jit
def _red_v4(ptrs, vals, valid, byte_offset: gl.constexpr):
    """``_red_v4_asm`` over a tile: ``ptrs`` as int64 and ``vals`` as their bits (the asm's arguments are broadcast
    together, which refuses a pointer beside a float)."""
    gl.inline_asm_elementwise(_red_v4_asm(byte_offset), "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
                              [ptrs, vals.to(gl.int32, bitcast=True), valid], dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _red_s64(ptrs, vals, valid, byte_offset: gl.constexpr):
    """``_red_s64_asm`` over a tile, arguments as ``_red_v4``'s (``vals`` the scaled fp32 values, as bits)."""
    gl.inline_asm_elementwise(_red_s64_asm(byte_offset), "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
                              [ptrs, vals.to(gl.int32, bitcast=True), valid], dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _copy_cols(dst, base, offs_r, stride_r, col0, NC: gl.constexpr, mask):
    """cp.async columns ``[col0, col0 + NC)`` of the rows ``base + offs_r * stride_r`` ([R] in the row layout;
    masked rows are zero-filled) into the same columns of ``dst``; 16 bytes a thread, ``NC / 8`` threads a row."""
    COLS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // (NC // 8), NC // 8],
                                          warps_per_cta=[4, 1], order=[1, 0])
    offs_d = gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, COLS)), 0)
    rows = gl.expand_dims(base + gl.convert_layout(offs_r, gl.SliceLayout(1, COLS)).to(gl.int64) * stride_r, 1)
    mask2 = gl.expand_dims(gl.convert_layout(mask, gl.SliceLayout(1, COLS)), 1)
    _cp_async(dst.slice(col0, NC, dim=1), rows + (offs_d + col0), mask=mask2)


@gluon.jit
def _copy_rows(dst, base, offs_r, stride_r, BD: gl.constexpr, mask):
    """cp.async rows ``base + offs_r * stride_r`` ([R] in the row layout; masked rows are zero-filled) into
    ``dst`` ([R, BD]), 128 columns at a time so that only one chunk's addresses are live."""
    CH: gl.constexpr = 128 if BD > 128 else BD
    for c in gl.static_range(BD // CH):
        _copy_cols(dst, base, offs_r, stride_r, c * CH, CH, mask)


@gluon.jit
def _buffers(q_all, do_all, k_all, p_all, ds_all, i, slot):
    """The shared-memory operands for key tile ``i``, through an index that is always 0 but opaque to the
    compiler (inline asm; a loop-guarded expression it folds). Otherwise it hoists every MMA's shared-memory
    descriptor out of the tile loop (about a hundred 64-bit values) and spills them, and each MMA then waits
    on a local-memory reload, the kernel's top stall (ncu) before this index."""
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
    return q_all.index(z), do_all.index(z), k_all.index(z), p_all.index(z + slot), ds_all.index(z + slot)


@gluon.jit
def _item_row(w, n_hb, idx, stride_it, BH: gl.constexpr):
    """Work item ``w`` = (query row, 64-head block): the row, the first head and the row's index list."""
    t = (w // n_hb).to(gl.int64)
    return t, (w % n_hb) * BH, idx + t * stride_it


@gluon.jit
def _item_tiles(n_keys, BK: gl.constexpr):
    """Key tiles of an item: at least one, so that every item takes the same barrier phases in both partitions
    (a tile of ``-1`` ids adds nothing)."""
    return gl.maximum(gl.cdiv(n_keys, BK), 1)


@gluon.jit
def _work_item(w, n_hb, idx, topk_len, stride_it, K, BH: gl.constexpr, BK: gl.constexpr, HAS_LEN: gl.constexpr):
    """Work item ``w``: its row, first head and index list (``_item_row``), key count and key tiles."""
    t, h0, _ = _item_row(w, n_hb, idx, stride_it, BH)
    idx_row, n_keys, _ = row_keys(idx, topk_len, t, stride_it, K, BK, HAS_LEN)
    return t, h0, idx_row, n_keys, _item_tiles(n_keys, BK)


@gluon.jit
def _score_partition(
    q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dsink_rows,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, K, scale, n_work, n_hb,
    smem,
    HAS_LEN: gl.constexpr, HAS_DLSE: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
):
    S_L: gl.constexpr = mma_layout(BK, 1)
    O_L: gl.constexpr = mma_layout(BD // 2, 1)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROWS: gl.constexpr = row_layout(4)
    CH: gl.constexpr = 128 if BD > 128 else BD
    dtype: gl.constexpr = q.dtype.element_ty
    QC: gl.constexpr = _QDO_COLS  # q and dO come in these many columns at a time
    q_all, do_all, k_all, p_all, ds_all, kv_full, kv_empty, pds_full, pds_empty, qdo_free = smem
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    qk_scale_log2 = scale * 1.4426950408889634
    s_zero = gl.zeros([BH, BK], gl.float32, layout=S_L)

    # The first item's first key tile; later items' first tiles are gathered at the end of the item before.
    _, _, idx_row, n_keys, _ = _work_item(pid, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
    ids_g = tile_ids(idx_row, 0, n_keys, BK, gl.SliceLayout(1, ROWS))
    _copy_rows(k_all.index(0), kv, ids_g, stride_kvn, BD, ids_g >= 0)
    g = 0  # key tiles done so far by this program: the per-tile barriers' phases
    it = 0  # items done so far: the phases of qdo_free
    for w in range(pid, n_work, n_prog):
        # This item's key count was read with the item before (its first gather); the next item's is read now,
        # once (a scan of its list), and carried over: one register through the tile loop.
        t, h0, idx_row = _item_row(w, n_hb, idx, stride_it, BH)
        n_tiles = _item_tiles(n_keys, BK)
        w_n = gl.minimum(w + n_prog, n_work - 1)  # the last item again at the end (its gather is skipped then)
        _, _, _, n_keys_n, _ = _work_item(w_n, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
        offs_hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ROWS))
        # Row terms first, while the key warpgroup may still be on the previous item's last chunks:
        # delta = rowsum(dO * O) - dlse from global, in column chunks, and the sink's share of the gradient.
        offs_cr = gl.arange(0, CH, layout=gl.SliceLayout(0, ROWS))
        row_o = t * stride_ot + gl.expand_dims(offs_hr, 1) * stride_oh + gl.expand_dims(offs_cr, 0)
        delta_r = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, ROWS))
        for c in gl.static_range(BD // CH):
            prod = gl.load(do + row_o + c * CH).to(gl.float32) * gl.load(o + row_o + c * CH).to(gl.float32)
            delta_r += gl.sum(prod, axis=1)
        offs_hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        delta = gl.convert_layout(delta_r, gl.SliceLayout(1, S_L))
        if HAS_DLSE:
            delta -= gl.load(dlse + t * stride_dlt + offs_hs)
        lse_t = gl.load(lse + t * stride_lt + offs_hs)
        # o depends on the sink only through lse and d lse / d sink = p_sink: dsink = -p_sink * delta.
        p_sink = gl.exp(gl.load(sink + offs_hs).to(gl.float32) - lse_t)
        gl.store(dsink_rows + t * H + offs_hs, -p_sink * delta)
        lse2 = gl.expand_dims(lse_t * 1.4426950408889634, 1)
        delta2 = gl.expand_dims(delta, 1)

        # q and dO, 64 columns at a time, each as soon as the previous item's last key-side chunk over those
        # columns is done with them (the first item's waits pass at once): the loads run under the key
        # warpgroup's last chunks instead of after them. Each thread's arrive on kv_full covers all of its copies,
        # so this phase also tells the key warpgroup that q and dO are there.
        all_rows = offs_hr >= 0
        for c in gl.static_range(BD // QC):
            mbarrier.wait(qdo_free.index(c), (it & 1) ^ 1)
            _copy_cols(q_all.index(0), q + t * stride_qt, offs_hr, stride_qh, c * QC, QC, all_rows)
            _copy_cols(do_all.index(0), do + t * stride_ot, offs_hr, stride_oh, c * QC, QC, all_rows)
        async_copy.mbarrier_arrive(kv_full, increment_count=False)
        it += 1
        ids_g = tile_ids(idx_row, BK, n_keys, BK, gl.SliceLayout(1, ROWS))

        dq_acc = gl.zeros([BH, BD // 2], gl.float32, layout=O_L)
        for i in range(n_tiles):
            phase = g & 1
            # P / dS take two slots by turns: the score warpgroup writes tile i + 1's while the key warpgroup
            # still reads tile i's, so the key warpgroup finds its next tile ready when it finishes one.
            slot = g & 1
            pds_phase = (g >> 1) & 1
            q_smem, do_smem, k_smem, p_smem, ds_smem = _buffers(q_all, do_all, k_all, p_all, ds_all, i, slot)
            k_lo = k_smem.slice(0, BD // 2, dim=1)
            mbarrier.wait(kv_full, phase)
            fence_async_shared()
            k_t = k_smem.permute((1, 0))
            s_tok = warpgroup_mma(q_smem, k_t, s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, k_t, s_zero, use_acc=False, is_async=True)
            valid = keys_valid(idx_row, i * BK, n_keys, BK, gl.SliceLayout(0, S_L))
            s_tile = warpgroup_mma_wait(1, deps=[s_tok])
            bias = gl.expand_dims(gl.where(valid, 0.0, float("-inf")), 0)
            p = gl.exp2(s_tile * qk_scale_log2 + bias - lse2)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = (p * (dp - delta2) * scale).to(dtype)
            # The key warpgroup is done with the previous tile's P and dS (the first wait passes at once).
            mbarrier.wait(pds_empty.index(slot), pds_phase ^ 1)
            p_smem.store(p.to(dtype))
            ds_smem.store(ds)
            fence_async_shared()
            mbarrier.arrive(pds_full.index(slot), count=1)
            dq_acc = warpgroup_mma(gl.convert_layout(ds, A_L), k_lo, dq_acc)
            mbarrier.arrive(kv_empty, count=1)
            # Both halves of dS K are done with the tile: gather the next one (of this item, or the first of
            # the next item) while the key warpgroup runs its chunks.
            if i + 1 < n_tiles:
                mbarrier.wait(kv_empty, phase)
                _copy_rows(k_smem, kv, ids_g, stride_kvn, BD, ids_g >= 0)
                async_copy.mbarrier_arrive(kv_full, increment_count=False)
                ids_g = tile_ids(idx_row, (i + 2) * BK, n_keys, BK, gl.SliceLayout(1, ROWS))
            elif w + n_prog < n_work:
                ids_n = tile_ids(_item_row(w_n, n_hb, idx, stride_it, BH)[2], 0, n_keys_n, BK, gl.SliceLayout(1, ROWS))
                mbarrier.wait(kv_empty, phase)
                _copy_rows(k_smem, kv, ids_n, stride_kvn, BD, ids_n >= 0)
            g += 1

        store_half(dq, t, h0, stride_qt, stride_qh, dq_acc.to(dtype), 0, BH, BD)
        n_keys = n_keys_n


@gluon.jit
def _key_tile(smem, dkv, idx_row, n_keys, dq_acc, c_zero, i, g, LAST: gl.constexpr, BD: gl.constexpr,
              BK: gl.constexpr, FIXED: gl.constexpr, fx_scale):
    """The key warpgroup's share of key tile ``i`` (the program's ``g``-th): its half of dS K into ``dq_acc``
    and the tile's dkv rows, ``P^T dO + dS^T q`` in 64-column chunks, two in flight, each reduced into ``dkv``
    as the next one runs. ``LAST``: the item's last tile, which also frees q and dO column piece by piece for
    the next item; a separate instance, because a runtime branch among the chunks puts partition barriers
    between them (slower)."""
    DC: gl.constexpr = 64  # key-side column chunk: [BK = 64, 64] tiles, the shape red_rows takes
    C_L: gl.constexpr = mma_layout(DC, 1)
    q_all, do_all, k_all, p_all, ds_all, kv_full, kv_empty, pds_full, pds_empty, qdo_free = smem
    # P / dS take two slots by turns: the score warpgroup writes tile i + 1's while the key warpgroup
    # still reads tile i's, so the key warpgroup finds its next tile ready when it finishes one.
    slot = g & 1
    q_smem, do_smem, k_smem, p_smem, ds_smem = _buffers(q_all, do_all, k_all, p_all, ds_all, i, slot)
    k_hi = k_smem.slice(BD // 2, BD // 2, dim=1)
    p_t = p_smem.permute((1, 0))
    ds_t = ds_smem.permute((1, 0))
    mbarrier.wait(kv_full, g & 1)
    mbarrier.wait(pds_full.index(slot), (g >> 1) & 1)
    fence_async_shared()
    dq_tok = warpgroup_mma(ds_smem, k_hi, dq_acc, is_async=True)
    ids_c = tile_ids(idx_row, i * BK, n_keys, BK, gl.SliceLayout(1, C_L))
    prev = warpgroup_mma(p_t, do_smem.slice(0, DC, dim=1), c_zero, use_acc=False, is_async=True)
    prev = warpgroup_mma(ds_t, q_smem.slice(0, DC, dim=1), prev, is_async=True)
    dq_acc = warpgroup_mma_wait(2, deps=[dq_tok])
    mbarrier.arrive(kv_empty, count=1)
    for c in gl.static_range(1, BD // DC):
        cur = warpgroup_mma(p_t, do_smem.slice(c * DC, DC, dim=1), c_zero, use_acc=False, is_async=True)
        cur = warpgroup_mma(ds_t, q_smem.slice(c * DC, DC, dim=1), cur, is_async=True)
        done = warpgroup_mma_wait(2, deps=[prev])
        if LAST and (c * DC) % _QDO_COLS == 0:
            # the item's last reads of the q and dO columns before c * DC: the next item's may come in
            mbarrier.arrive(qdo_free.index(c * DC // _QDO_COLS - 1), count=1)
        red_rows(dkv, ids_c, done, (c - 1) * DC, BD, FIXED, fx_scale)
        prev = cur
    done = warpgroup_mma_wait(0, deps=[prev])
    mbarrier.arrive(pds_empty.index(slot), count=1)
    if LAST:
        mbarrier.arrive(qdo_free.index(BD // _QDO_COLS - 1), count=1)
    red_rows(dkv, ids_c, done, BD - DC, BD, FIXED, fx_scale)
    return dq_acc


@gluon.jit
def _key_partition(
    idx, topk_len, dq, dkv, stride_qt, stride_qh, stride_it, K, n_work, n_hb,
    smem,
    HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr, FIXED: gl.constexpr, fx,
):
    C_L: gl.constexpr = mma_layout(64, 1)
    O_L: gl.constexpr = mma_layout(BD // 2, 1)
    dtype: gl.constexpr = smem[0].dtype
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    c_zero = gl.zeros([BK, 64], gl.float32, layout=C_L)
    fx_scale = 1.0
    if FIXED:  # dkv is int64 fixed point: 2**e, read once (fixed_point.py)
        fx_scale = gl.load(fx)

    g = 0
    for w in range(pid, n_work, n_prog):
        _, _, idx_row, n_keys, n_tiles = _work_item(w, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
        dq_acc = gl.zeros([BH, BD // 2], gl.float32, layout=O_L)
        for i in range(n_tiles - 1):
            dq_acc = _key_tile(smem, dkv, idx_row, n_keys, dq_acc, c_zero, i, g, False, BD, BK, FIXED, fx_scale)
            g += 1
        dq_acc = _key_tile(smem, dkv, idx_row, n_keys, dq_acc, c_zero, n_tiles - 1, g, True, BD, BK, FIXED,
                           fx_scale)
        g += 1
        # the row and head block again from w, rather than kept live through the tiles
        store_half(dq, (w // n_hb).to(gl.int64), (w % n_hb) * BH, stride_qt, stride_qh, dq_acc.to(dtype), 1, BH, BD)


@gluon.jit
def sparse_attn_bwd_gluon_kernel(
    q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dkv, dsink_rows, fx,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, K, scale, n_work, n_hb,
    HAS_LEN: gl.constexpr, HAS_DLSE: gl.constexpr,
    BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr, KEY_REGS: gl.constexpr, FIXED: gl.constexpr,
):
    # FIXED (deterministic mode, red_rows): dkv is an int64 buffer of fixed-point sums, in its stored column order,
    # and fx the fp32 [3] of fixed_point.fixed_point_scale; False: fp32 sums, fx unused
    dtype: gl.constexpr = q.dtype.element_ty
    KV_SL: gl.constexpr = mma_smem(BD * 2)
    P_SL: gl.constexpr = mma_smem(BK * 2)
    q_smem = gl.allocate_shared_memory(dtype, [1, BH, BD], KV_SL)
    do_smem = gl.allocate_shared_memory(dtype, [1, BH, BD], KV_SL)
    k_smem = gl.allocate_shared_memory(dtype, [1, BK, BD], KV_SL)
    p_smem = gl.allocate_shared_memory(dtype, [2, BH, BK], P_SL)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BH, BK], P_SL)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [BD // _QDO_COLS, 1], mbarrier.MBarrierLayout())
    kv_full = bars.index(0)
    kv_empty = bars.index(1)
    pds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # by slot: it is written
    pds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # by slot: it was read
    mbarrier.init(kv_full, count=128)  # one cp.async arrive per thread of the score warpgroup
    mbarrier.init(kv_empty, count=2)  # one arrive per warpgroup
    for b in gl.static_range(2):
        mbarrier.init(pds_full.index(b), count=1)
        mbarrier.init(pds_empty.index(b), count=1)
    for c in gl.static_range(BD // _QDO_COLS):
        mbarrier.init(qdo_free.index(c), count=1)  # the key warpgroup, once an item
    smem = (q_smem, do_smem, k_smem, p_smem, ds_smem, kv_full, kv_empty, pds_full, pds_empty, qdo_free)
    gl.warp_specialize([
        (_score_partition, (q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dsink_rows,
                            stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
                            stride_dlt, H, K, scale, n_work, n_hb, smem, HAS_LEN, HAS_DLSE, BH, BD, BK)),
        (_key_partition, (idx, topk_len, dq, dkv, stride_qt, stride_qh, stride_it, K, n_work, n_hb, smem,
                          HAS_LEN, BH, BD, BK, FIXED, fx)),
    ], [4], [KEY_REGS])

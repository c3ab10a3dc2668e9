"""Hopper sparse attention backward in one warp-specialized Gluon kernel: ``dq``, ``dkv`` and the per-row
``dsink`` terms.

Same contract and math as the Triton pair ``sparse_attn_bwd_kernel_dq`` + ``sparse_attn_bwd_kernel_dkv`` in
``triton.py`` (README.md). A work item is one query row x 64 heads; a program loops over items (persistent: one
program an SM by default, so an item's row terms and first gather run under the last chunks of the item
before). Its two warpgroups have one job each and run out of phase, handing work over through shared memory and
mbarriers:

- the *score* warpgroup (the default partition) gathers each 64-key tile (``cp.async``), computes
  ``S = Q K^T`` and ``dP = dO K^T`` whole (m64n64, K = d), then ``P`` and ``scale dS``, writes both to shared
  memory and adds ``dS K`` into the left half of ``dq`` with ``dS`` straight from registers (A operand);
- the *key* warpgroup (a worker partition) adds ``dS K`` into the right half of ``dq`` from shared memory, then
  computes the key-side tile ``P^T dO + (scale dS)^T Q`` in 64-column chunks, two chunks in flight on the tensor
  cores while the previous chunk's fp32 reductions into ``dkv`` go out as whole-line ``red.v4`` (``red_rows``).

Barriers: ``kv_full`` (the tile's copies landed: one ``cp.async`` arrive per score thread; its first phase also
covers the q and dO copies), ``kv_empty`` (both halves of ``dS K`` are done with the tile, so the next gather
starts while the key warpgroup is still on its chunks), ``pds_full`` / ``pds_empty`` (the ``P`` / ``dS`` slot).
q and dO are copied once per row; one key slot and one ``P`` / ``dS`` slot: 208 KB of shared memory at d = 512.
``dkv`` is not bitwise reproducible run to run (atomics); dq and dsink are.

Measured on the H200 (bf16, H = 64, d = 512, k + W = 640): 4.49 ms at 8k tokens, 18.36 ms at 32k (374 TFLOP/s),
against 6.38 / 26.26 ms for the earlier lockstep Gluon kernel (both warpgroups splitting every product), 39.9 ms at
32k for the Triton pair, and 4.04 / 17.56 ms for cuDNN Frontend 1.32's SM90 kernel in the same run (BENCHMARKS.md).
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

from .gluon_fwd import _cp_async, keys_valid, mma_layout, mma_smem, row_keys, row_layout, row_piece_layout, tile_ids

__all__ = ["sparse_attn_bwd_gluon_kernel"]


@gluon.constexpr_function
def red_layout(full_lines):
    """Register layout of a ``[64, 64]`` fp32 key-side tile of one warpgroup for its reductions into ``dkv``:
    each thread holds 4 adjacent columns in consecutive registers (one ``red.v4``); ``full_lines``: a warp
    instruction covers 4 rows x 128 bytes (whole L2 lines), else 8 rows x 64 bytes. Rows stay with the warp
    that computed them, and each step from the MMA layout trades one lane bit for one register bit, so the
    conversions are shuffles within a warp (no shared memory)."""
    if not full_lines:
        return row_piece_layout(64)  # the first trade
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0], [1, 0], [0, 32]],
                                      lane_bases=[[0, 8], [0, 4], [0, 16], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])


@gluon.jit
def red_rows(dkv, ids, tile, col0, BD: gl.constexpr):
    """``dkv[ids[r], col0 + c] += tile[r, c]`` for a ``[64, 64]`` MMA-layout tile (fp32 relaxed reductions,
    ``-1`` ids skipped).

    In the MMA layout thread ``a`` of a quad holds columns ``8 j + 2 a + {0, 1}``: a warp's reduction adds 8 rows
    x 32 bytes, which L2 serves as 8 one-sector requests, and that request rate bounded the kernel (L2 at 72-78 %
    of peak). Whole lines cut the requests 4x (measured 22.7 -> 18.3 ms at 32k tokens)."""
    layout: gl.constexpr = red_layout(True)
    vals = gl.convert_layout(gl.convert_layout(tile, red_layout(False)), layout)
    ids_r = gl.convert_layout(ids, gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    ptrs = gl.expand_dims(dkv + ids_r.to(gl.int64) * BD + col0, 1) + gl.expand_dims(cols, 0)
    gl.atomic_add(ptrs, vals, mask=gl.expand_dims(ids_r >= 0, 1), sem="relaxed")


@gluon.jit
def _copy_rows(dst, base, offs_r, stride_r, BD: gl.constexpr, mask):
    """cp.async rows ``base + offs_r * stride_r`` ([R] in the row layout; masked rows are zero-filled) into
    ``dst`` ([R, BD]), 128 columns at a time so that only one chunk's addresses are live."""
    CH: gl.constexpr = 128 if BD > 128 else BD
    offs_d = gl.expand_dims(gl.arange(0, CH, layout=gl.SliceLayout(0, row_layout(4))), 0)
    rows = gl.expand_dims(base + offs_r.to(gl.int64) * stride_r, 1)
    mask2 = gl.expand_dims(mask, 1)
    for c in gl.static_range(BD // CH):
        _cp_async(dst.slice(c * CH, CH, dim=1), rows + (offs_d + c * CH), mask=mask2)


@gluon.jit
def _buffers(q_all, do_all, k_all, p_all, ds_all, i):
    """The shared-memory operands for key tile ``i``, through an index that is always 0 but opaque to the
    compiler (inline asm; a loop-guarded expression it folds). Otherwise it hoists every MMA's shared-memory
    descriptor out of the tile loop (about a hundred 64-bit values) and spills them, and each MMA then waits
    on a local-memory reload: that was the top stall (ncu); 1.3 KB of spills -> 104 bytes, 30.0 -> 22.7 ms
    at 32k tokens."""
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
    return q_all.index(z), do_all.index(z), k_all.index(z), p_all.index(z), ds_all.index(z)


@gluon.jit
def _work_item(w, n_hb, idx, topk_len, stride_it, K, BH: gl.constexpr, BK: gl.constexpr, HAS_LEN: gl.constexpr):
    """Work item ``w`` = (query row, 64-head block): the row, the first head, the row's index list, key count and
    number of key tiles (at least one, so that every item takes the same barrier phases in both partitions; a
    tile of ``-1`` ids adds nothing)."""
    t = (w // n_hb).to(gl.int64)
    h0 = (w % n_hb) * BH
    idx_row, n_keys, n_tiles = row_keys(idx, topk_len, t, stride_it, K, BK, HAS_LEN)
    return t, h0, idx_row, n_keys, gl.maximum(n_tiles, 1)


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
    q_all, do_all, k_all, p_all, ds_all, kv_full, kv_empty, pds_full, pds_empty = smem
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    qk_scale_log2 = scale * 1.4426950408889634
    s_zero = gl.zeros([BH, BK], gl.float32, layout=S_L)

    # The first item's first key tile; later items' first tiles are gathered at the end of the item before.
    t, h0, idx_row, n_keys, n_tiles = _work_item(pid, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
    ids_g = tile_ids(idx_row, 0, n_keys, BK, gl.SliceLayout(1, ROWS))
    _copy_rows(k_all.index(0), kv, ids_g, stride_kvn, BD, ids_g >= 0)
    g = 0  # key tiles done so far by this program: the barriers' phases
    for w in range(pid, n_work, n_prog):
        t, h0, idx_row, n_keys, n_tiles = _work_item(w, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
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

        # q and dO once the previous item's key-side products are done with them; each thread's arrive on
        # kv_full covers all of its copies, so this phase also tells the key warpgroup that q and dO are there.
        mbarrier.wait(pds_empty, (g & 1) ^ 1)
        all_rows = offs_hr >= 0
        _copy_rows(q_all.index(0), q + t * stride_qt, offs_hr, stride_qh, BD, all_rows)
        _copy_rows(do_all.index(0), do + t * stride_ot, offs_hr, stride_oh, BD, all_rows)
        async_copy.mbarrier_arrive(kv_full, increment_count=False)
        ids_g = tile_ids(idx_row, BK, n_keys, BK, gl.SliceLayout(1, ROWS))

        dq_acc = gl.zeros([BH, BD // 2], gl.float32, layout=O_L)
        for i in range(n_tiles):
            phase = g & 1
            q_smem, do_smem, k_smem, p_smem, ds_smem = _buffers(q_all, do_all, k_all, p_all, ds_all, i)
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
            mbarrier.wait(pds_empty, phase ^ 1)
            p_smem.store(p.to(dtype))
            ds_smem.store(ds)
            fence_async_shared()
            mbarrier.arrive(pds_full, count=1)
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
                t_n, h_n, idx_n, n_keys_n, n_tiles_n = _work_item(w + n_prog, n_hb, idx, topk_len, stride_it, K,
                                                                  BH, BK, HAS_LEN)
                ids_n = tile_ids(idx_n, 0, n_keys_n, BK, gl.SliceLayout(1, ROWS))
                mbarrier.wait(kv_empty, phase)
                _copy_rows(k_smem, kv, ids_n, stride_kvn, BD, ids_n >= 0)
            g += 1

        offs_ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
        offs_do = gl.arange(0, BD // 2, layout=gl.SliceLayout(0, O_L))
        gl.store(dq + t * stride_qt + gl.expand_dims(offs_ho, 1) * stride_qh + gl.expand_dims(offs_do, 0),
                 dq_acc.to(dtype))


@gluon.jit
def _key_partition(
    idx, topk_len, dq, dkv, stride_qt, stride_qh, stride_it, K, n_work, n_hb,
    smem,
    HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
):
    DC: gl.constexpr = 64  # key-side column chunk: [BK = 64, 64] tiles, the shape red_rows takes
    C_L: gl.constexpr = mma_layout(DC, 1)
    O_L: gl.constexpr = mma_layout(BD // 2, 1)
    q_all, do_all, k_all, p_all, ds_all, kv_full, kv_empty, pds_full, pds_empty = smem
    dtype: gl.constexpr = q_all.dtype
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    c_zero = gl.zeros([BK, DC], gl.float32, layout=C_L)

    g = 0
    for w in range(pid, n_work, n_prog):
        t, h0, idx_row, n_keys, n_tiles = _work_item(w, n_hb, idx, topk_len, stride_it, K, BH, BK, HAS_LEN)
        dq_acc = gl.zeros([BH, BD // 2], gl.float32, layout=O_L)
        for i in range(n_tiles):
            phase = g & 1
            q_smem, do_smem, k_smem, p_smem, ds_smem = _buffers(q_all, do_all, k_all, p_all, ds_all, i)
            k_hi = k_smem.slice(BD // 2, BD // 2, dim=1)
            p_t = p_smem.permute((1, 0))
            ds_t = ds_smem.permute((1, 0))
            mbarrier.wait(kv_full, phase)
            mbarrier.wait(pds_full, phase)
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
                red_rows(dkv, ids_c, done, (c - 1) * DC, BD)
                prev = cur
            done = warpgroup_mma_wait(0, deps=[prev])
            mbarrier.arrive(pds_empty, count=1)
            red_rows(dkv, ids_c, done, BD - DC, BD)
            g += 1

        offs_ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
        offs_do = BD // 2 + gl.arange(0, BD // 2, layout=gl.SliceLayout(0, O_L))
        gl.store(dq + t * stride_qt + gl.expand_dims(offs_ho, 1) * stride_qh + gl.expand_dims(offs_do, 0),
                 dq_acc.to(dtype))


@gluon.jit
def sparse_attn_bwd_gluon_kernel(
    q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dkv, dsink_rows,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, K, scale, n_work, n_hb,
    HAS_LEN: gl.constexpr, HAS_DLSE: gl.constexpr,
    BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr, KEY_REGS: gl.constexpr,
):
    dtype: gl.constexpr = q.dtype.element_ty
    KV_SL: gl.constexpr = mma_smem(BD * 2)
    P_SL: gl.constexpr = mma_smem(BK * 2)
    q_smem = gl.allocate_shared_memory(dtype, [1, BH, BD], KV_SL)
    do_smem = gl.allocate_shared_memory(dtype, [1, BH, BD], KV_SL)
    k_smem = gl.allocate_shared_memory(dtype, [1, BK, BD], KV_SL)
    p_smem = gl.allocate_shared_memory(dtype, [1, BH, BK], P_SL)
    ds_smem = gl.allocate_shared_memory(dtype, [1, BH, BK], P_SL)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    kv_full = bars.index(0)
    kv_empty = bars.index(1)
    pds_full = bars.index(2)
    pds_empty = bars.index(3)
    mbarrier.init(kv_full, count=128)  # one cp.async arrive per thread of the score warpgroup
    mbarrier.init(kv_empty, count=2)  # one arrive per warpgroup
    mbarrier.init(pds_full, count=1)
    mbarrier.init(pds_empty, count=1)
    smem = (q_smem, do_smem, k_smem, p_smem, ds_smem, kv_full, kv_empty, pds_full, pds_empty)
    gl.warp_specialize([
        (_score_partition, (q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dsink_rows,
                            stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
                            stride_dlt, H, K, scale, n_work, n_hb, smem, HAS_LEN, HAS_DLSE, BH, BD, BK)),
        (_key_partition, (idx, topk_len, dq, dkv, stride_qt, stride_qh, stride_it, K, n_work, n_hb, smem,
                          HAS_LEN, BH, BD, BK)),
    ], [4], [KEY_REGS])

"""Hopper sparse attention forward written in Gluon (Triton's explicit-layout dialect).

Same contract and math as ``sparse_attn_fwd_kernel`` in ``triton.py`` (README.md); this kernel exists for speed
on sm_90. Triton lays the ``[64, BK]`` score product of that kernel out on both warpgroups, each computing all
of it, because its result feeds the second product from registers. Here the layouts are chosen by hand:

- the score tile ``S = Q K^T`` is split by keys between the two warpgroups (``warps_per_cta = [4, 2]``), so
  each warpgroup issues half of the score product instead of all of it;
- the softmax runs on that split tile (the row max crosses warpgroups through the compiler's reduction; the row
  sum is kept per element and reduced once after the loop);
- ``P`` goes once through shared memory (``[64, BK]`` bf16) and is the shared-memory A operand of ``P V``,
  whose ``[64, d]`` accumulator is split by columns between the warpgroups;
- the key gather is a two-slot shared-memory ring filled with ``cp.async`` one tile ahead, issued while the
  score product of the current tile runs (asynchronous warpgroup MMA);
- a program loops over work items (one query row x 64 heads; ``fwd_persistent`` programs an SM) and the ring
  runs on across items: under an item's last tile it gathers the next item's first key tile, and once both
  warpgroups' last score products are done it loads the next item's q into the freed q buffer, so the next item
  starts on landed data instead of waiting for its q and first keys. One program per item (205 KB of shared
  memory, one program an SM) left that wait and the epilogue exposed: at 32k the time was 2.29 ms + 0.585 ms a
  64-key tile (4 / 10 / 20 tiles a row: 4.63 / 8.14 / 13.98 ms), 28 % of it per item at k + W = 640;
- the ``o`` block leaves through the key slot its last tile used, so its global stores are 16-byte pieces of
  contiguous rows (from the MMA layout they were 4-byte pieces, and that epilogue took 15 % of the time).

Measured on the H200 (bf16, H = 64, d = 512, k + W = 640, 32k tokens): 6.96 ms, 395 TFLOP/s (one program per
item with the MMA-layout stores: 8.1 ms, 338 TFLOP/s; the Triton kernel 11.3 ms, 244 TFLOP/s; BENCHMARKS.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

__all__ = ["sparse_attn_fwd_gluon_kernel"]

# The cp.async builtin was renamed (Triton 3.6: async_copy_global_to_shared, later: async_load).
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# The CTA-wide barrier likewise (3.6: thread_barrier, later: barrier).
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


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


@gluon.jit
def row_keys(idx, topk_len, t, stride_it, K, BK: gl.constexpr, HAS_LEN: gl.constexpr):
    """Row ``t``'s index list, its key count (``topk_len`` limits it when given) and its number of key tiles."""
    idx_row = idx + t * stride_it
    n_keys = K
    if HAS_LEN:
        n_keys = gl.minimum(gl.load(topk_len + t).to(gl.int32), K)
    return idx_row, n_keys, gl.cdiv(n_keys, BK)


@gluon.jit
def item_keys(idx, topk_len, w, n_work, n_hb, K, HAS_LEN: gl.constexpr):
    """The key count of work item ``w`` (row ``w // n_hb``; 0 past the last item)."""
    _, n_keys, _ = row_keys(idx, topk_len, gl.minimum(w, n_work - 1) // n_hb, 0, K, 1, HAS_LEN)
    return gl.where(w < n_work, n_keys, 0)


@gluon.jit
def issue_rows(row_ptrs, mask, buf, BD: gl.constexpr):
    """cp.async the rows starting at ``row_ptrs`` ([R] in the row layout; masked rows are zero-filled) into
    ``buf``, as one commit group."""
    offs_d = gl.arange(0, BD, layout=gl.SliceLayout(0, row_layout()))
    _cp_async(buf, gl.expand_dims(row_ptrs, 1) + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(mask, 1))
    async_copy.commit_group()


@gluon.jit
def issue_gather(kv, ids, stride_kvn, buf, BD: gl.constexpr):
    """cp.async the key rows ``ids`` ([BK] in the row layout; -1 = none, zero-filled) into ``buf``."""
    issue_rows(kv + ids.to(gl.int64) * stride_kvn, ids >= 0, buf, BD)


@gluon.jit
def issue_q(q, t, h0, stride_qt, stride_qh, valid, buf, BH: gl.constexpr, BD: gl.constexpr):
    """cp.async the ``[BH, d]`` query block of row ``t``, heads from ``h0``, into ``buf`` (zeros if not valid)."""
    offs_h = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, row_layout()))
    mask = gl.full([BH], 1, gl.int1, layout=gl.SliceLayout(1, row_layout())) & valid
    issue_rows(q + t * stride_qt + offs_h.to(gl.int64) * stride_qh, mask, buf, BD)


@gluon.jit
def tile_ids(idx_row, start, n_keys, BK: gl.constexpr, layout: gl.constexpr):
    offs = start + gl.arange(0, BK, layout=layout)
    return gl.load(idx_row + offs, mask=offs < n_keys, other=-1)


@gluon.jit
def sparse_attn_fwd_gluon_kernel(
    q, kv, idx, topk_len, sink, o, lse,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    K, qk_scale_log2, n_work, n_hb,
    HAS_LEN: gl.constexpr, BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr,
):
    # The score tile split by keys, the accumulator by columns, both between the two warpgroups. A key slot holds
    # as many rows as the o block (BK = BH), so the epilogue can stage o in it.
    gl.static_assert(BK == BH, "the epilogue stages the o block in a key slot")
    S_L: gl.constexpr = mma_layout(BK // 2, 2)
    O_L: gl.constexpr = mma_layout(BD // 2, 2)
    ROWS: gl.constexpr = row_layout()
    dtype: gl.constexpr = q.dtype.element_ty

    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    # Two key slots (a third does not fit next to q at d = 512), q, P.
    k_bufs = gl.allocate_shared_memory(dtype, [2, BK, BD], mma_smem(BD * 2))
    p_smem = gl.allocate_shared_memory(dtype, [BH, BK], mma_smem(BK * 2))
    q_smem = gl.allocate_shared_memory(dtype, [BH, BD], mma_smem(BD * 2))
    s_zero = gl.zeros([BH, BK], gl.float32, layout=S_L)

    g = 0  # key tiles this program has consumed: tile g sits in ring slot g % 2
    ready = 0  # whether the item before issued this item's q and first key tile
    # Key counts of this item and the next, read an item ahead so that no item waits on them.
    n_keys = item_keys(idx, topk_len, pid, n_work, n_hb, K, HAS_LEN)
    n_keys_next = item_keys(idx, topk_len, pid + n_prog, n_work, n_hb, K, HAS_LEN)
    for w in range(pid, n_work, n_prog):
        n_keys_after = item_keys(idx, topk_len, w + 2 * n_prog, n_work, n_hb, K, HAS_LEN)
        t = (w // n_hb).to(gl.int64)
        h0 = (w % n_hb) * BH
        idx_row = idx + t * stride_it
        n_tiles = gl.cdiv(n_keys, BK)
        if (ready == 0) & (n_tiles > 0):
            # This program's first item, or the one after an item without keys (which issued nothing): drain
            # whatever that item's predecessor issued into these buffers, then load q and the first tile here.
            async_copy.wait_group(0)
            issue_gather(kv, tile_ids(idx_row, 0, n_keys, BK, gl.SliceLayout(1, ROWS)), stride_kvn,
                         k_bufs.index(g % 2), BD)
            issue_q(q, t, h0, stride_qt, stride_qh, True, q_smem, BH, BD)
        # The next item of this program, whose q and first key tile this item's last tile issues.
        w_next = gl.minimum(w + n_prog, n_work - 1)
        t_next = (w_next // n_hb).to(gl.int64)
        h0_next = (w_next % n_hb) * BH
        # The index list of the tile the first iteration gathers: this item's second, or the next item's first.
        more = n_tiles > 1
        ids_g = tile_ids(idx + gl.where(more, t, t_next) * stride_it, gl.where(more, BK, 0),
                         gl.where(more, n_keys, n_keys_next), BK, gl.SliceLayout(1, ROWS))

        # The sink is the softmax's starting state (max = sink, sum = 1), as in the Triton kernel.
        offs_hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        m_i = gl.load(sink + offs_hs).to(gl.float32) * 1.4426950408889634
        l_sink = gl.full([BH], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
        l_acc = gl.zeros([BH, BK], gl.float32, layout=S_L)
        acc = gl.zeros([BH, BD], gl.float32, layout=O_L)

        for i in range(n_tiles):
            # Tile i (and at i = 0 this item's q) has landed (this thread's copies), then every thread's copies
            # are visible and both warpgroups are done with tile i - 1: its slot may be refilled.
            async_copy.wait_group(0)
            fence_async_shared()
            _cta_barrier()
            k_tile = k_bufs.index(g % 2)
            # The score product runs on the tensor cores while the threads issue the next gather (this item's
            # tile i + 1, or after its last tile the next item's first) and read the index list of the gather
            # after it, so no load latency sits between the two products.
            s_tok = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            ids_s = tile_ids(idx_row, i * BK, n_keys, BK, gl.SliceLayout(0, S_L))
            issue_gather(kv, ids_g, stride_kvn, k_bufs.index((g + 1) % 2), BD)
            ahead = i + 2 < n_tiles
            ids_g = tile_ids(idx + gl.where(ahead, t, t_next) * stride_it, gl.where(ahead, (i + 2) * BK, 0),
                             gl.where(ahead, n_keys, gl.where(i + 2 == n_tiles, n_keys_next, 0)), BK,
                             gl.SliceLayout(1, ROWS))
            last = i + 1 == n_tiles
            s_tile = warpgroup_mma_wait(0, deps=[s_tok])
            bias = gl.where(ids_s >= 0, 0.0, float("-inf"))
            s_tile = s_tile * qk_scale_log2 + gl.expand_dims(bias, 0)
            m_new = gl.maximum(m_i, gl.max(s_tile, axis=1))
            p = gl.exp2(s_tile - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
            # The row sum is kept per element and reduced once after the loop: a row's columns live on both
            # warpgroups, so a per-tile sum would cost a cross-warpgroup exchange (measured 8.5 -> 8.1 ms at 32k).
            l_sink = l_sink * alpha
            l_acc = l_acc * gl.expand_dims(alpha, 1) + p
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()
            if last:
                # Both warpgroups' score products are done (the barrier above): q's buffer takes the next item's
                # q while this tile's P V and the epilogue run.
                issue_q(q, t_next, h0_next, stride_qt, stride_qh, n_keys_next > 0, q_smem, BH, BD)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
            acc = warpgroup_mma(p_smem, k_tile, acc)
            g += 1
        ready = (n_tiles > 0).to(gl.int32)
        n_keys = n_keys_next
        n_keys_next = n_keys_after
        l_i = l_sink + gl.sum(l_acc, axis=1)

        # One reciprocal a row instead of a division an element.
        out = (acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, O_L)), 1)).to(dtype)
        # The o block leaves through the key slot the last tile used (free once both warpgroups are past their
        # last P V: the barrier; next written by the next item's second gather, after that item's first barrier),
        # so the global stores are whole 16-byte pieces of contiguous rows. Stored from the MMA layout they were
        # 4-byte pieces, half a sector each: 15 % of the kernel's time at 32k went to the epilogue, most of it
        # waiting to issue those stores (ncu, dfd9e2d).
        o_smem = k_bufs.index((g + 1) % 2)
        _cta_barrier()
        o_smem.store(out)
        _cta_barrier()
        offs_hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ROWS))
        offs_dr = gl.arange(0, BD, layout=gl.SliceLayout(0, ROWS))
        gl.store(o + t * stride_ot + gl.expand_dims(offs_hr, 1) * stride_oh + gl.expand_dims(offs_dr, 0),
                 o_smem.load(ROWS))
        gl.store(lse + t * stride_lt + offs_hs, m_i * 0.6931471805599453 + gl.log(l_i))
    async_copy.wait_group(0)

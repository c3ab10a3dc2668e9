"""Hopper sparse attention backward in one Gluon kernel: ``dq``, ``dkv`` and the per-row ``dsink`` terms.

Same contract and math as the Triton pair ``sparse_attn_bwd_kernel_dq`` + ``sparse_attn_bwd_kernel_dkv`` in
``triton.py`` (README.md). Per row and 64-head block, for each tile of ``BK`` gathered keys:

- ``S = Q K^T`` and ``dP = dO K^T`` split by keys between the two warpgroups (as in ``gluon_fwd.py``), so
  ``P``, ``dP`` and ``dS = P (dP - delta)`` of a key sit in the same thread;
- ``P`` and ``scale * dS`` go to shared memory once (bf16); from there they are the A operand of
  ``dq += (scale dS) K`` (accumulator split by columns) and, transposed, of the key-side product
  ``dkv_tile = P^T dO + (scale dS)^T Q`` (``[BK, d]``), computed in column chunks of ``DC`` and added into the
  fp32 ``[N, d]`` buffer with relaxed fp32 atomics, as the Triton dkv kernel does;
- the next tile's gather is issued as soon as ``dS K`` is done with the key tile, under the dkv chunks.

The Triton pair computes ``S`` and ``dP`` twice (once per kernel, each on both warpgroups) and gathers every key
tile twice; here they are computed and gathered once. q and dO stay in shared memory (128 KB at d = 512), which
leaves one 64-key slot. ``dkv`` is not bitwise reproducible run to run (atomics); dq and dsink are.

Measured on the H200 (bf16, H = 64, d = 512, k + W = 640, 32k tokens): 26.1 ms, 263 TFLOP/s, against 39.9 ms
(172 TFLOP/s) for the Triton pair (BENCHMARKS.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .gluon_fwd import _cta_barrier, issue_gather, mma_smem, row_keys, row_layout, split_mma, tile_ids

__all__ = ["sparse_attn_bwd_gluon_kernel"]


@gluon.jit
def sparse_attn_bwd_gluon_kernel(
    q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dkv, dsink_rows,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, K, scale,
    HAS_LEN: gl.constexpr, HAS_DLSE: gl.constexpr,
    BH: gl.constexpr, BD: gl.constexpr, BK: gl.constexpr, DC: gl.constexpr,
):
    # S and dP split by keys, the dq accumulator and the dkv chunks by columns, between the two warpgroups.
    S_L: gl.constexpr = split_mma(BK // 2)
    O_L: gl.constexpr = split_mma(BD // 2)
    C_L: gl.constexpr = split_mma(DC // 2)
    ROWS: gl.constexpr = row_layout()
    KV_SL: gl.constexpr = mma_smem(BD * 2)
    P_SL: gl.constexpr = mma_smem(BK * 2)
    dtype: gl.constexpr = q.dtype.element_ty

    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BH
    idx_row, n_keys, n_tiles = row_keys(idx, topk_len, t, stride_it, K, BK, HAS_LEN)

    k_smem = gl.allocate_shared_memory(dtype, [BK, BD], KV_SL)
    p_smem = gl.allocate_shared_memory(dtype, [BH, BK], P_SL)
    ds_smem = gl.allocate_shared_memory(dtype, [BH, BK], P_SL)
    ids_g = tile_ids(idx_row, 0, n_keys, BK, gl.SliceLayout(1, ROWS))
    issue_gather(kv, ids_g, stride_kvn, k_smem, BD)
    ids_g = tile_ids(idx_row, BK, n_keys, BK, gl.SliceLayout(1, ROWS))

    # Row terms: q and dO into shared memory, delta = rowsum(dO * O) - dlse, the sink's share of the gradient.
    offs_hr = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ROWS))
    offs_dr = gl.arange(0, BD, layout=gl.SliceLayout(0, ROWS))
    row_q = t * stride_qt + gl.expand_dims(offs_hr, 1) * stride_qh + gl.expand_dims(offs_dr, 0)
    row_o = t * stride_ot + gl.expand_dims(offs_hr, 1) * stride_oh + gl.expand_dims(offs_dr, 0)
    q_smem = gl.allocate_shared_memory(dtype, [BH, BD], KV_SL, gl.load(q + row_q))
    do_regs = gl.load(do + row_o)
    delta_r = gl.sum(do_regs.to(gl.float32) * gl.load(o + row_o).to(gl.float32), axis=1)
    do_smem = gl.allocate_shared_memory(dtype, [BH, BD], KV_SL, do_regs)
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
    qk_scale_log2 = scale * 1.4426950408889634

    offs_c = gl.arange(0, DC, layout=gl.SliceLayout(0, C_L))
    dq_acc = gl.zeros([BH, BD], gl.float32, layout=O_L)
    s_zero = gl.zeros([BH, BK], gl.float32, layout=S_L)
    c_zero = gl.zeros([BK, DC], gl.float32, layout=C_L)
    p_t = p_smem.permute((1, 0))
    ds_t = ds_smem.permute((1, 0))
    for i in range(n_tiles):
        # Tile i has landed; every warpgroup is done with the P / dS buffers of tile i - 1.
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        k_t = k_smem.permute((1, 0))
        s_tok = warpgroup_mma(q_smem, k_t, s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_smem, k_t, s_zero, use_acc=False, is_async=True)
        ids_s = tile_ids(idx_row, i * BK, n_keys, BK, gl.SliceLayout(0, S_L))
        ids_c = tile_ids(idx_row, i * BK, n_keys, BK, gl.SliceLayout(1, C_L))
        s_tile = warpgroup_mma_wait(1, deps=[s_tok])
        bias = gl.expand_dims(gl.where(ids_s >= 0, 0.0, float("-inf")), 0)
        p = gl.exp2(s_tile * qk_scale_log2 + bias - lse2)
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds = p * (dp - delta2) * scale
        p_smem.store(p.to(dtype))
        ds_smem.store(ds.to(dtype))
        fence_async_shared()
        _cta_barrier()
        dq_acc = warpgroup_mma(ds_smem, k_smem, dq_acc)
        # Both warpgroups are done with the key tile: gather the next one under the key-side products.
        _cta_barrier()
        issue_gather(kv, ids_g, stride_kvn, k_smem, BD)
        ids_g = tile_ids(idx_row, (i + 2) * BK, n_keys, BK, gl.SliceLayout(1, ROWS))
        rows = gl.expand_dims(dkv + ids_c.to(gl.int64) * BD, 1)
        valid = gl.expand_dims(ids_c >= 0, 1)
        for c in gl.static_range(BD // DC):
            acc_c = warpgroup_mma(p_t, do_smem.slice(c * DC, DC, dim=1), c_zero, use_acc=False)
            acc_c = warpgroup_mma(ds_t, q_smem.slice(c * DC, DC, dim=1), acc_c)
            gl.atomic_add(rows + gl.expand_dims(c * DC + offs_c, 0), acc_c, mask=valid, sem="relaxed")
    async_copy.wait_group(0)

    offs_ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    offs_do = gl.arange(0, BD, layout=gl.SliceLayout(0, O_L))
    gl.store(dq + t * stride_qt + gl.expand_dims(offs_ho, 1) * stride_qh + gl.expand_dims(offs_do, 0),
             dq_acc.to(dtype))

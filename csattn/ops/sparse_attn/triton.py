"""Fused Triton sparse attention with a per-head sink (MQA, one shared K = V head), forward and backward.

Layout contract: ``q [T, H, d]``, ``kv [N, d]`` (last dim contiguous), ``indices [T, K]`` int32/int64 with
``-1`` = no key, optional ``topk_length [T]`` (only the first ``topk_length[t]`` entries of row ``t`` count),
``sink [H]`` fp32. One program owns one query row and a block of ``BH`` heads (all of them when H <= 64):
the row's gathered keys are loaded once and reused by every head, so ``QK^T`` is a real ``[BH, d] x [d, BK]``
matrix product. Only ``o`` and ``lse`` are saved; the backward recomputes the scores. README.md has the math.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autograd import named_grads
from ..backend import interpreting, sm_count, triton_version
from ..fixed_point import abs_max, fixed_point_scale, from_fixed_point
from .config import SparseAttnConfig

__all__ = [
    "SparseAttnConfig",
    "sparse_attn_bwd",
    "sparse_attn_fwd",
    "sparse_attn_triton",
    "uses_gluon_bwd",
    "dkv_in_stored_order",
    "dkv_columns",
    "uses_gluon_fwd",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def sparse_attn_fwd_kernel(
    q, kv, idx, topk_len, sink, o, lse,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt,
    H, D, K, qk_scale_log2,
    HAS_LEN: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # The [BH = 64, BK] score tile feeds P V straight from registers; Triton lays it out on both warpgroups, each
    # computing all of it (3 MMA units issued per 2 counted). Taking it key-major (S^T = K Q^T, P through a
    # transpose) avoids that but is slower (README, "Why this design").
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    mask_h = offs_h < H
    mask_d = offs_d < D
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q_ptrs = q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=mask_hd, other=0.0)
    # The sink is the softmax's starting state: running max = sink, running sum = exp(sink - sink) = 1.
    # This keeps the max finite (no NaN on empty rows) and folds the sink into lse for free.
    m_i = tl.load(sink + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BH], 1.0, dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    n_keys = K
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(topk_len + t).to(tl.int32), K)
    for start in range(0, n_keys, BK):
        offs_k = start + tl.arange(0, BK)
        ids = tl.load(idx + t * stride_it + offs_k, mask=offs_k < n_keys, other=-1)
        valid = ids >= 0
        k_tile = tl.load(kv + ids.to(tl.int64)[:, None] * stride_kvn + offs_d[None, :],
                         mask=valid[:, None] & mask_d[None, :], other=0.0)
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PREC) * qk_scale_log2  # [BH, BK]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        p_sum = tl.sum(p, 1)
        p = p.to(k_tile.dtype)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + p_sum
        acc = acc * alpha[:, None] + tl.dot(p, k_tile, input_precision=DOT_PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=mask_hd)
    tl.store(lse + t * stride_lt + offs_h, m_i * 0.6931471805599453 + tl.log(l_i), mask=mask_h)


@triton.jit
def _bwd_row_terms(q, o, do, lse, dlse, t, offs_h, offs_d, mask_h, mask_hd,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_dlt, HAS_DLSE: tl.constexpr):
    """Per-row tiles of both backward kernels: q, do, lse and delta = rowsum(do * o) - dlse."""
    row_q = t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    row_o = t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    q_tile = tl.load(q + row_q, mask=mask_hd, other=0.0)
    do_tile = tl.load(do + row_o, mask=mask_hd, other=0.0)
    o_tile = tl.load(o + row_o, mask=mask_hd, other=0.0)
    # dS = P (dP - delta); dlse enters delta because lse is an output too.
    delta = tl.sum(do_tile.to(tl.float32) * o_tile.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse + t * stride_dlt + offs_h, mask=mask_h, other=0.0)
    # Padded heads get lse = +inf, hence P = 0.
    lse_t = tl.load(lse + t * stride_lt + offs_h, mask=mask_h, other=float("inf"))
    return q_tile, do_tile, delta, lse_t


@triton.jit
def sparse_attn_bwd_kernel_dq(
    q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dsink_rows,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, D, K, scale,
    HAS_LEN: tl.constexpr, HAS_DLSE: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Row-major products: q and do are A operands, the key tile the B operand of all three dots (the key-major
    # form, S^T and dP^T with the key tile as shared A operand, is slower: README).
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    mask_h = offs_h < H
    mask_d = offs_d < D
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q_tile, do_tile, delta, lse_t = _bwd_row_terms(
        q, o, do, lse, dlse, t, offs_h, offs_d, mask_h, mask_hd,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_dlt, HAS_DLSE)
    # o depends on the sink only through lse and d lse / d sink = p_sink: dsink = -p_sink * delta.
    p_sink = tl.exp(tl.load(sink + offs_h, mask=mask_h, other=0.0).to(tl.float32) - lse_t)
    tl.store(dsink_rows + t * H + offs_h, -p_sink * delta, mask=mask_h)
    lse2 = lse_t * 1.4426950408889634
    qk_scale_log2 = scale * 1.4426950408889634
    dq_acc = tl.zeros([BH, BD], dtype=tl.float32)
    n_keys = K
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(topk_len + t).to(tl.int32), K)
    for start in range(0, n_keys, BK):
        offs_k = start + tl.arange(0, BK)
        ids = tl.load(idx + t * stride_it + offs_k, mask=offs_k < n_keys, other=-1)
        valid = ids >= 0
        k_tile = tl.load(kv + ids.to(tl.int64)[:, None] * stride_kvn + offs_d[None, :],
                         mask=valid[:, None] & mask_d[None, :], other=0.0)
        # ds: gradient w.r.t. the scaled score, [BH, BK]
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PREC) * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do_tile, tl.trans(k_tile), input_precision=DOT_PREC)
        ds = (p * (dp - delta[:, None])).to(k_tile.dtype)
        dq_acc += tl.dot(ds, k_tile, input_precision=DOT_PREC)
    tl.store(dq + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
             (dq_acc * scale).to(dq.dtype.element_ty), mask=mask_hd)


@triton.jit
def _load_qdo_chunk(q, do, off_r, is_do, mask_r, offs_c, D):
    """Rows ``2h`` = q[h], ``2h+1`` = do[h] of one column chunk: ``[2*BH, BDC]``."""
    ptrs = tl.where(is_do[:, None], do + off_r + offs_c[None, :], q + off_r + offs_c[None, :])
    return tl.load(ptrs, mask=mask_r[:, None] & (offs_c < D)[None, :], other=0.0)


@triton.jit
def _load_key_chunk(kv, key_off, valid, offs_c, D):
    return tl.load(kv + key_off + offs_c[None, :], mask=valid[:, None] & (offs_c < D)[None, :], other=0.0)


@triton.jit
def _add_dkv_chunk(dkv, w, qd, ids64, valid, offs_c, D, DOT_PREC: tl.constexpr, fx_scale, FIXED: tl.constexpr):
    blk = tl.dot(w, qd, input_precision=DOT_PREC)
    if FIXED:  # deterministic: exact int64 sums of round(x * 2**e), the same bits in any order (fixed_point.py)
        blk = tl.floor(blk * fx_scale + 0.5).to(tl.int64)
    tl.atomic_add(dkv + ids64[:, None] * D + offs_c[None, :], blk,
                  mask=valid[:, None] & (offs_c < D)[None, :], sem="relaxed")


@triton.jit
def sparse_attn_bwd_kernel_dkv(
    q, kv, idx, topk_len, o, do, lse, dlse, dkv, fx,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, stride_lt, stride_dlt,
    H, D, K, scale,
    HAS_LEN: tl.constexpr, HAS_DLSE: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr, FIXED: tl.constexpr = False,
):
    # Key-major: [S^T | dP^T] = K [Q; dO]^T and dKV = [dS^T | P^T] [Q; dO], with q and do rows
    # interleaved in one [2*BH, d] operand. That operand is only ever a B operand (one shared-memory
    # copy, no A/B duplicate), the score product gets N = 2*BH, and the dkv tile comes from one MMA.
    # d is cut into four column chunks so each dkv tile (and its layout change before the atomics)
    # stays at [BK, d/4]: whole-d tiles do not fit in shared memory at d = 512.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    mask_h = offs_h < H
    mask_hd = mask_h[:, None] & (offs_d < D)[None, :]
    row_o = t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    delta = tl.sum(tl.load(do + row_o, mask=mask_hd, other=0.0).to(tl.float32)
                   * tl.load(o + row_o, mask=mask_hd, other=0.0).to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse + t * stride_dlt + offs_h, mask=mask_h, other=0.0)
    lse2 = tl.load(lse + t * stride_lt + offs_h, mask=mask_h, other=float("inf")) * 1.4426950408889634
    qk_scale_log2 = scale * 1.4426950408889634

    # FIXED (config.deterministic): dkv is an int64 buffer of fixed-point sums, fx points at the fp32 2**e
    fx_scale = 1.0
    if FIXED:
        fx_scale = tl.load(fx)
    BDC: tl.constexpr = BD // 4
    r = tl.arange(0, 2 * BH)
    h2 = hb * BH + r // 2
    is_do = (r % 2) == 1
    mask_r = h2 < H
    off_r = t * stride_qt + h2[:, None] * stride_qh  # q and do share one layout (the host checks)
    offs_c = tl.arange(0, BDC)
    qd0 = _load_qdo_chunk(q, do, off_r, is_do, mask_r, offs_c, D)
    qd1 = _load_qdo_chunk(q, do, off_r, is_do, mask_r, offs_c + BDC, D)
    qd2 = _load_qdo_chunk(q, do, off_r, is_do, mask_r, offs_c + 2 * BDC, D)
    qd3 = _load_qdo_chunk(q, do, off_r, is_do, mask_r, offs_c + 3 * BDC, D)

    n_keys = K
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(topk_len + t).to(tl.int32), K)
    for start in range(0, n_keys, BK):
        offs_k = start + tl.arange(0, BK)
        ids = tl.load(idx + t * stride_it + offs_k, mask=offs_k < n_keys, other=-1)
        valid = ids >= 0
        ids64 = ids.to(tl.int64)
        key_off = ids64[:, None] * stride_kvn
        k0 = _load_key_chunk(kv, key_off, valid, offs_c, D)
        k1 = _load_key_chunk(kv, key_off, valid, offs_c + BDC, D)
        k2 = _load_key_chunk(kv, key_off, valid, offs_c + 2 * BDC, D)
        k3 = _load_key_chunk(kv, key_off, valid, offs_c + 3 * BDC, D)
        sd = tl.dot(k0, tl.trans(qd0), input_precision=DOT_PREC)
        sd = tl.dot(k1, tl.trans(qd1), sd, input_precision=DOT_PREC)
        sd = tl.dot(k2, tl.trans(qd2), sd, input_precision=DOT_PREC)
        sd = tl.dot(k3, tl.trans(qd3), sd, input_precision=DOT_PREC)
        st, dpt = tl.split(tl.reshape(sd, [BK, BH, 2]))  # columns 2h: q . k, 2h+1: do . k
        st = tl.where(valid[:, None], st * qk_scale_log2, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])
        dst = pt * (dpt - delta[None, :]) * scale  # gradient w.r.t. the raw score q . k
        # K = V: the key gradient dS^T Q and the value gradient P^T dO land in the same kv row.
        w = tl.reshape(tl.join(dst, pt), [BK, 2 * BH]).to(k0.dtype)
        _add_dkv_chunk(dkv, w, qd0, ids64, valid, offs_c, D, DOT_PREC, fx_scale, FIXED)
        _add_dkv_chunk(dkv, w, qd1, ids64, valid, offs_c + BDC, D, DOT_PREC, fx_scale, FIXED)
        _add_dkv_chunk(dkv, w, qd2, ids64, valid, offs_c + 2 * BDC, D, DOT_PREC, fx_scale, FIXED)
        _add_dkv_chunk(dkv, w, qd3, ids64, valid, offs_c + 3 * BDC, D, DOT_PREC, fx_scale, FIXED)


# ----------------------------------------------------------------------------------------------------------
# host functions
# ----------------------------------------------------------------------------------------------------------


_DEFAULT = SparseAttnConfig()
_log = logging.getLogger(__name__)
_REPORTED: set = set()


def _report(what: str, kernel, cfg: SparseAttnConfig) -> None:
    """At DEBUG level of this module's logger, log registers, spills and shared memory once per kernel and config
    (for tuning runs: ``logging.getLogger("csattn.ops.sparse_attn.triton").setLevel(logging.DEBUG)``)."""
    if kernel is None or not _log.isEnabledFor(logging.DEBUG):
        return
    key = (what, type(cfg), tuple(sorted(cfg.as_dict().items())))
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    _log.debug("sparse_attn %s %s: regs=%s spills=%s shared=%s", what, cfg.as_dict(), getattr(kernel, "n_regs", "?"),
               getattr(kernel, "n_spills", "?"), shared)


def _head_block(h: int, cfg: SparseAttnConfig) -> int:
    # tl.dot needs M >= 16; above 64 heads a second head block re-gathers the keys (cheap next to the math).
    return cfg.bh or min(max(triton.next_power_of_2(h), 16), 64)


def _fit(cfg: SparseAttnConfig, dtype: torch.dtype, d: int) -> SparseAttnConfig:
    """Shrink the tiles for wider elements: the defaults fill shared memory at bf16/fp16, d = 512."""
    over = dtype.itemsize * max(triton.next_power_of_2(d), 16) / 1024
    if over <= 1:
        return cfg
    bh, bk_fwd, bk_dq, bk_dkv = cfg.bh, cfg.bk_fwd, cfg.bk_dq, cfg.bk_dkv
    while over > 1:
        bh = max(16, (bh or 64) // 2)
        bk_fwd, bk_dq, bk_dkv = (max(16, b // 2) for b in (bk_fwd, bk_dq, bk_dkv))
        over /= 2
    return cfg.replace(bh=bh, bk_fwd=bk_fwd, bk_dq=bk_dq, bk_dkv=bk_dkv, stages_fwd=1, stages_dq=1, stages_dkv=1)


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (the oracle role); bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _gluon_kernel(name: str):
    """A Gluon kernel (``"fwd"`` or ``"bwd"``), or None where this Triton's Gluon may not take it.

    Gluon is experimental API that changes between releases: the kernels were measured on Triton 3.6 and compile
    on 3.9 (a CPU test compiles them for sm_90); older releases run the Triton kernels.
    """
    if triton_version() < (3, 6):
        return None
    try:
        if name == "fwd":
            from .gluon_fwd import sparse_attn_fwd_gluon_kernel as kernel
        else:
            from .gluon_bwd import sparse_attn_bwd_gluon_kernel as kernel
    except (ImportError, AttributeError):
        return None
    return kernel


def _gluon_applies(q: Tensor, kv: Tensor, cfg: SparseAttnConfig) -> bool:
    """The Gluon kernels are written for Hopper's warpgroup MMA: sm_90, bf16/fp16, whole 64-head blocks, d a
    power of two in 128..512 (each warpgroup's half of o / dq is at least an m64n64 product), 16-byte aligned rows
    for their cp.async gathers."""
    if q.device.type != "cuda" or interpreting():
        return False
    T, H, D = q.shape
    if (q.dtype not in (torch.bfloat16, torch.float16) or H % 64 or cfg.bh not in (None, 64)
            or D not in (128, 256, 512)):
        return False
    if (q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or kv.stride(1) != 1 or kv.stride(0) % 8
            or q.data_ptr() % 16 or kv.data_ptr() % 16):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


def _programs(n_work: int, device: torch.device) -> int:
    """Grid of a persistent Gluon kernel: one program an SM looping over ``n_work`` items (lab/NOTES.md has the
    numbers of one program per item and of two an SM)."""
    return min(n_work, sm_count(device))


def uses_gluon_fwd(q: Tensor, kv: Tensor, cfg: SparseAttnConfig) -> bool:
    """Whether :func:`sparse_attn_fwd` runs the Gluon kernel for these inputs (else the Triton kernel; it takes
    64-key tiles, ``bk_fwd``)."""
    return (bool(cfg.fwd_gluon) and cfg.bk_fwd == 64 and _gluon_applies(q, kv, cfg)
            and _gluon_kernel("fwd") is not None)


def uses_gluon_bwd(q: Tensor, kv: Tensor, cfg: SparseAttnConfig) -> bool:
    """Whether :func:`sparse_attn_bwd` runs the one Gluon kernel (dq, dkv, dsink) instead of the Triton pair (in
    deterministic mode with its fixed-point sums, ``FIXED``)."""
    return bool(cfg.bwd_gluon) and _gluon_applies(q, kv, cfg) and _gluon_kernel("bwd") is not None


def _fixed_stored(acc: Tensor, fx: Tensor) -> Tensor:
    """The Gluon fixed-point variant's int64 sums ``acc`` as fp32 in the kernel's stored column order (what
    :func:`dkv_columns` takes): ``from_fixed_point`` with each 32-column half de-interleaved (stored place
    ``(f & 3) * 8 + (f >> 2)`` holds half column ``f``, ``gluon_bwd.red_rows``)."""
    N, D = acc.shape
    return from_fixed_point(acc, fx).view(N, D // 64, 2, 4, 8).transpose(3, 4).reshape(N, D)


def _dkv_bound(q: Tensor, kv: Tensor, o: Tensor, do: Tensor, dlse: Tensor | None, scale: float) -> Tensor:
    """A bound on every partial sum of ``dkv`` (``fixed_point.py``), on the device from the inputs' maxima: each
    ``(t, h)`` adds ``sum_j p_j (do + scale (dp_j - delta) q)`` over its keys with ``sum_j p_j <= 1``, ``|dp_j|,
    |do . o| <= d max|do| max|kv|`` (``o`` is a convex combination of kv rows), so ``|dkv| <= T H (max|do| + scale
    max|q| (2 d max|do| max|kv| + max|dlse|))``; doubled for the rounding of ``p`` / ``dS`` to bf16 and of the
    products."""
    T, H, D = q.shape
    m_do = abs_max(do)
    inner = 2 * D * m_do * abs_max(kv)
    if dlse is not None:
        inner = inner + abs_max(dlse)
    return 2.0 * T * H * (m_do + scale * abs_max(q) * inner)


def sparse_attn_fwd(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float,
    topk_length: Tensor | None = None, config: SparseAttnConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Shapes as in :func:`sparse_attn_triton`; returns ``(o, lse)``.

    ``config``: launch settings (None: the defaults of :class:`SparseAttnConfig`)."""
    T, H, D = q.shape
    cfg = _fit(config or _DEFAULT, q.dtype, D)
    K = indices.shape[1]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(T, H, device=q.device, dtype=torch.float32)
    if T == 0:
        return o, lse
    if uses_gluon_fwd(q, kv, cfg):
        n_work = T * (H // 64)
        kernel = _gluon_kernel("fwd")[(_programs(n_work, q.device),)](
            q, kv, indices, topk_length if topk_length is not None else indices, sink, o, lse,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), o.stride(0), o.stride(1), lse.stride(0),
            K, scale * LOG2E, n_work, H // 64,
            HAS_LEN=topk_length is not None, BH=64, BD=D, BK=64,
            SIDE1_REGS=cfg.fwd_side_regs,
            PRODUCER_REGS=cfg.fwd_producer_regs, num_warps=4,
        )
        _report("fwd_gluon", kernel, cfg)
        return o, lse
    bh = _head_block(H, cfg)
    grid = (T, triton.cdiv(H, bh))
    kernel = sparse_attn_fwd_kernel[grid](
        q, kv, indices, topk_length if topk_length is not None else indices, sink, o, lse,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), o.stride(0), o.stride(1), lse.stride(0),
        H, D, K, scale * LOG2E,
        HAS_LEN=topk_length is not None, BH=bh, BD=max(triton.next_power_of_2(D), 16), BK=cfg.bk_fwd,
        DOT_PREC=_dot_prec(q.dtype), num_warps=cfg.warps_fwd,
        num_stages=cfg.stages_fwd,
    )
    _report("fwd", kernel, cfg)
    return o, lse


def dkv_columns(stored: Tensor, out: Tensor, accumulate: bool) -> None:
    """``out`` ([N, d], d a multiple of 64) = (or += with ``accumulate``) the Gluon backward's ``dkv`` sums
    ``stored`` ([N, d] fp32, each 64-column chunk in the order ``gluon_bwd._stored_columns`` writes: stored column
    ``f`` holds column ``(f & 49) | (f & 2) << 2 | (f & 12) >> 1``) in true column order; one pass, cast to
    ``out``'s dtype on the way."""
    N, D = stored.shape
    src = stored.view(N, D // 64, 2, 2, 2, 2, 2, 2).permute(0, 1, 2, 3, 6, 4, 5, 7)
    dst = out.view(N, D // 64, 2, 2, 2, 2, 2, 2)
    if accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)


def dkv_in_stored_order(q: Tensor, kv: Tensor, config: SparseAttnConfig | None = None) -> bool:
    """Whether :func:`sparse_attn_bwd` on these inputs sums ``dkv`` in the Gluon kernel's stored column order, so
    that a caller keeping its own sum over blocks may pass ``dkv_accum_stored=True`` and call :func:`dkv_columns`
    once at the end (the same answer for every block of the same q / kv dtypes, heads, d and config whose rows are
    16-byte aligned; a block that is not is refused by ``dkv_accum_stored``, never summed in the wrong order)."""
    cfg = _fit(config or _DEFAULT, q.dtype, q.shape[-1])
    return uses_gluon_bwd(q, kv, cfg) and not cfg.deterministic


def sparse_attn_bwd(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, o: Tensor, lse: Tensor,
    do: Tensor, dlse: Tensor | None = None, topk_length: Tensor | None = None,
    config: SparseAttnConfig | None = None, dkv_accum: Tensor | None = None, dkv_accum_stored: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Launch the backward. Returns ``(dq [T,H,d] q.dtype, dkv [N,d] kv.dtype, dsink [H] sink.dtype)``.

    ``dkv`` is accumulated with fp32 atomics (``N * d * 4`` bytes of workspace); the summation order
    of those atomics is not fixed, so ``dkv`` is not bitwise deterministic. ``dsink`` is reduced from
    per-row partials in a fixed order. With ``dkv_accum`` (fp32 ``[N, d]``) the atomics add into it and
    ``dkv`` is returned as None: a caller running the backward block by block keeps one fp32 sum. The Gluon
    kernel sums in a column order of its own: without ``dkv_accum_stored`` it sums into a buffer of its own and
    adds that to ``dkv_accum`` in true order (a pass over ``[N, d]`` per call); with it (only where
    :func:`dkv_in_stored_order`), it sums into ``dkv_accum`` directly and :func:`dkv_columns` puts the sum in order.
    ``config``: launch settings (None: the defaults); pass the forward's to reproduce its ``(o, lse)``.
    With ``config.deterministic`` (the Gluon kernel's fixed-point variant where the Gluon kernel applies, else the
    Triton pair) ``dkv`` is summed exactly in int64 fixed point (``fixed_point.py``; an ``N * d * 8`` bytes buffer
    of its own, added to ``dkv_accum`` in one pass at the end): the same bits run to run. ``dkv_accum_stored`` is
    refused in this mode.
    """
    T, H, D = q.shape
    cfg = _fit(config or _DEFAULT, q.dtype, D)
    K = indices.shape[1]
    do = do.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    if T > 0 and (do.stride() != o.stride() or q.stride() != o.stride()):
        raise ValueError("q, o and do must share one [T, H, d] layout (make them contiguous)")
    dq = torch.empty_like(q)
    if dkv_accum is not None and (dkv_accum.shape != kv.shape or dkv_accum.dtype != torch.float32
                                  or not dkv_accum.is_contiguous()):
        raise ValueError(f"dkv_accum must be contiguous fp32 {tuple(kv.shape)}, got {tuple(dkv_accum.shape)} "
                         f"{dkv_accum.dtype}")
    if dkv_accum_stored and (dkv_accum is None or not dkv_in_stored_order(q, kv, cfg)):
        raise ValueError("dkv_accum_stored=True takes a dkv_accum and the Gluon backward: ask "
                         "dkv_in_stored_order(q, kv, config) first")
    gluon = T > 0 and uses_gluon_bwd(q, kv, cfg)
    # The Gluon kernel keeps each 64-column chunk of its sums in its own column order (dkv_columns puts them
    # back), so it sums into a caller's buffer only where the caller keeps that order.
    own = dkv_accum is None or (gluon and not dkv_accum_stored)
    fixed = bool(cfg.deterministic)
    if fixed:
        dkv32 = torch.zeros(kv.shape, device=kv.device, dtype=torch.int64)
        fx = fixed_point_scale(_dkv_bound(q, kv, o, do, dlse, scale)) if T > 0 else None
    else:
        dkv32 = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32) if own else dkv_accum
    dsink_rows = torch.empty(T, H, device=q.device, dtype=torch.float32)
    if T > 0:
        bh = _head_block(H, cfg)
        grid = (T, triton.cdiv(H, bh))
        common = dict(
            q=q, kv=kv, idx=indices, topk_len=topk_length if topk_length is not None else indices,
            o=o, do=do, lse=lse, dlse=dlse if dlse is not None else lse,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kvn=kv.stride(0),
            stride_it=indices.stride(0), stride_ot=o.stride(0), stride_oh=o.stride(1), stride_lt=lse.stride(0),
            stride_dlt=dlse.stride(0) if dlse is not None else 0,
            H=H, D=D, K=K, scale=scale, HAS_LEN=topk_length is not None, HAS_DLSE=dlse is not None,
            BH=bh, BD=max(triton.next_power_of_2(D), 16), DOT_PREC=_dot_prec(q.dtype),
        )
        if gluon:
            # One warp-specialized kernel for dq, dkv and dsink (64-head blocks, d = BD, 64-key tiles); the key
            # warpgroup keeps 240 registers of the 256 a thread may have (fewer spill in its tile loop).
            del common["D"], common["BH"], common["BD"], common["DOT_PREC"]
            n_work = T * (H // 64)
            # FIXED: int64 fixed-point sums into dkv32 (gluon_bwd.red_rows)
            kernel = _gluon_kernel("bwd")[(_programs(n_work, q.device),)](
                sink=sink, dq=dq, dkv=dkv32, dsink_rows=dsink_rows, fx=fx if fixed else dkv32, n_work=n_work,
                n_hb=H // 64, BH=64, BD=D, BK=64, KEY_REGS=240, FIXED=fixed, num_warps=4, **common)
            _report("bwd_gluon", kernel, cfg)
        else:
            kernel = sparse_attn_bwd_kernel_dq[grid](
                sink=sink, dq=dq, dsink_rows=dsink_rows, BK=cfg.bk_dq,
                num_warps=cfg.warps_dq, num_stages=cfg.stages_dq, **common)
            _report("bwd_dq", kernel, cfg)
            common["BD"] = max(common["BD"], 64)  # four column chunks of >= 16
            kernel = sparse_attn_bwd_kernel_dkv[grid](
                dkv=dkv32, fx=fx if fixed else dkv32, BK=cfg.bk_dkv, num_warps=cfg.warps_dkv,
                num_stages=cfg.stages_dkv, FIXED=fixed, **common)
            _report("bwd_dkv", kernel, cfg)
    dsink = dsink_rows.sum(0).to(sink.dtype)
    if fixed:
        if T == 0:
            return dq, None if dkv_accum is not None else torch.zeros_like(kv), dsink
        if gluon:  # the Gluon variant's sums are in its stored column order
            dkv = dkv_accum if dkv_accum is not None else torch.empty_like(kv)
            dkv_columns(_fixed_stored(dkv32, fx), dkv, accumulate=dkv_accum is not None)
            return dq, None if dkv_accum is not None else dkv, dsink
        if dkv_accum is not None:
            from_fixed_point(dkv32, fx, out=dkv_accum, accumulate=True)
            return dq, None, dsink
        return dq, from_fixed_point(dkv32, fx, dtype=kv.dtype), dsink
    if gluon and own:
        dkv = dkv_accum if dkv_accum is not None else torch.empty_like(kv)
        dkv_columns(dkv32, dkv, accumulate=dkv_accum is not None)
        return dq, None if dkv_accum is not None else dkv, dsink
    return dq, None if dkv_accum is not None else dkv32.to(kv.dtype), dsink


# ----------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------


class SparseAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, sink, scale, topk_length, config):
        o, lse = sparse_attn_fwd(q, kv, indices, sink, scale, topk_length, config)
        ctx.config = config  # the backward launches with the forward's settings (a frozen value)
        ctx.set_materialize_grads(False)  # an unused lse (the usual case) then costs nothing in the backward
        ctx.save_for_backward(q, kv, indices, sink, o, lse, topk_length)
        ctx.scale = scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, kv, indices, sink, o, lse, topk_length = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dkv, dsink = sparse_attn_bwd(q, kv, indices, sink, ctx.scale, o, lse, do, dlse, topk_length,
                                         ctx.config)
        return _SparseAttnGrads(q=dq, kv=dkv, sink=dsink)


_SparseAttnGrads = named_grads(SparseAttnFunction)


# ----------------------------------------------------------------------------------------------------------
# public function
# ----------------------------------------------------------------------------------------------------------


def _check(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, topk_length: Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, d], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv must be [N, {D}] (one shared K=V head), got shape {tuple(kv.shape)}")
    if D > 512:
        raise ValueError(f"q/kv head dim d={D} is above the supported 512")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv dtype {kv.dtype} must equal q dtype {q.dtype}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be [T={T}, K], got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [H={H}], got shape {tuple(sink.shape)}")
    if topk_length is not None and (
        topk_length.shape != (T,) or topk_length.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"topk_length must be int [{T}], got {tuple(topk_length.shape)} {topk_length.dtype}")
    for name, t in (("q", q), ("kv", kv), ("indices", indices), ("sink", sink)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: put all inputs on one device")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")


def sparse_attn_triton(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    topk_length: Tensor | None = None,
    config: SparseAttnConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused sparse attention with a per-head sink: ``o[t,h] = sum_j p_j kv[j]``,
    ``p_j = exp(s_j - lse)``, ``s_j = scale * q[t,h] . kv[indices[t,j]]``,
    ``lse = log(sum_j exp(s_j) + exp(sink_h))``.

    Same semantics as :func:`~csattn.ops.sparse_attn.naive.sparse_attn_ref`; differentiable in ``q``,
    ``kv``, ``sink`` (and through ``lse``). Nothing of size ``T x K`` is kept for the backward.

    Args:
        q: ``[T, H, d]`` bf16/fp16/fp32, ``d <= 512``.
        kv: ``[N, d]`` same dtype: the one shared key = value head.
        indices: ``[T, K]`` int32/int64 rows of ``kv``; ``-1`` = no key. Values must be ``< N``.
        sink: ``[H]`` fp32 sink logits.
        scale: softmax scale (``d ** -0.5``).
        topk_length: optional ``[T]`` int; only the first ``topk_length[t]`` entries of row ``t`` are used
            (a ragged index list without ``-1`` padding; the layer pads with ``-1`` and passes None).
        config: kernel launch settings (:class:`SparseAttnConfig`; None: the defaults). The backward uses the
            forward's.

    Returns:
        ``o [T, H, d]`` in q's dtype (zeros for rows without keys) and ``lse [T, H]`` fp32 (``= sink`` there).

    Example:
        >>> o, lse = sparse_attn_triton(q, kv, idx, sink, q.shape[-1] ** -0.5)
    """
    _check(q, kv, indices, sink, topk_length)
    q = q.contiguous()  # the backward reuses q's layout for o, do and dq
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    if config is not None and not isinstance(config, SparseAttnConfig):
        raise TypeError(f"config must be a SparseAttnConfig, got {type(config).__name__}")
    return SparseAttnFunction.apply(q, kv, indices, sink.contiguous(), float(scale), topk_length,
                                    config or _DEFAULT)

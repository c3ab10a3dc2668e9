"""mHC (hyper-connection) pre-mapping, final head and combine as fused Triton kernels, forward and backward.

Why: in plain autograd one mHC site makes and keeps several fp32 ``[T, n*D]`` copies of the streams (the cast,
the normalized rows, the product) and launches ~100 small kernels (20 Sinkhorn rounds of ``[T, n, n]`` ops).
Here a site keeps only the streams it was given (the model keeps them anyway), the ``[T, M]`` mixing logits and
one ``1 / rms`` per row (``M = (2+n)*n``, or ``n`` for the head); the backward recomputes everything else.

Pre-mapping (``M = (2+n)*n``; the head is the same kernels with ``M = n``, sigmoid only):

- forward, one program per ``BT`` rows: a pass over ``x [BT, n*D]`` accumulates ``sum(x^2)`` and
  ``x @ fn^T`` (``rstd`` is one scalar per row, so ``mix = rstd * (x @ fn^T)``); the program writes ``mix``
  and ``rstd``, reads its ``mix`` back group by group (pre ``[BT, n]``, post ``[BT, n]``, comb
  ``[BT, n, n]``), runs the sigmoids, the softmax and the Sinkhorn rounds in registers and a second pass
  over its rows collapses them, ``sum_j pre_j X_j``.
- backward, kernel 1 (per ``BT`` rows): ``dpre_j = sum_d dcollapsed * X_j``, then the gradient of the
  logits: sigmoid derivatives, the Sinkhorn rounds run again storing each round's input in a scratch buffer
  that lives only during this kernel, their backward in reverse, the softmax backward. It writes
  ``g = rstd * dmix [T, M]``, ``e = rstd^2 / (n*D) * sum_m dmix_m mix_m [T]`` (the ``rstd`` path) and
  ``pre [T, n]``, and per-program partial sums of the ``base`` / ``scale`` gradients.
- backward, kernel 2 (per channel tile x group of row blocks): ``dX = g @ fn - e X + pre_j dcollapsed`` and
  the ``fn`` gradient ``g^T @ X`` summed in registers over the group's rows; the host adds the few group
  partials (deterministic, no atomics).

The products run on tensor cores when the streams are bf16 (a bf16 value is exact in the MMA): the fp32 operand
is split into three bf16 parts (``hi + mid + lo`` carries its 24 bits), so every product is exact and sums in
fp32, as an fp32 GEMM would. Other stream dtypes use the fp32 (fp64) FMA path (``input_precision="ieee"``).

Combine ``X'_k = post_k y + sum_j comb[j, k] X_j`` (``post`` / ``comb`` rounded to the stream dtype first,
like the reference): the forward is one program per (rows, channel tile); the backward one program per rows
looping over channels, writing ``dX``, ``dy`` and reducing ``dpost [T, n]``, ``dcomb [T, n, n]`` in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autograd import named_grads
from ..backend import interpreting, sm_count
from ..rms_norm import rms_norm_backward, rms_norm_forward
from .config import MhcConfig

__all__ = ["hc_site_triton", "hc_pre_triton", "hc_head_triton", "hc_combine_triton"]



# ---------------------------------------------------------------------------------------------- helpers
@triton.jit
def _sigmoid(a):
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def _split3(v, INTERP: tl.constexpr):
    """fp32 ``v`` as three bf16 parts with ``hi + mid + lo == v`` to 24 bits (fp32 copies under the CPU
    interpreter, whose dot does not take bf16)."""
    hi = v.to(tl.bfloat16)
    r = v - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    if INTERP:
        hi, mid, lo = hi.to(tl.float32), mid.to(tl.float32), lo.to(tl.float32)
    return hi, mid, lo


@triton.jit
def _mma_operand(x, cdt: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """A bf16 stream tile as the dot takes it: itself on tensor cores, else in the compute dtype."""
    if not SPLIT or INTERP:
        x = x.to(cdt)
    return x


@triton.jit
def _group(mix, rows, rmask, off, M: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """Columns ``off .. off+N-1`` of the row-major ``[T, M]`` logits as ``[BT, NP]`` (0 past ``N``), and the mask."""
    j = tl.arange(0, NP)
    m = rmask[:, None] & (j < N)[None, :]
    return tl.load(mix + rows[:, None] * M + off + j[None, :], mask=m, other=0.0), m


@triton.jit
def _pre_weights(mix, base, scale, rows, rmask, hc_eps, M: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """``pre = sigmoid(mix[:n] * scale[0] + base[:n]) + eps`` ``[BT, NP]`` (0 on padding), the sigmoid, the
    logits and the mask."""
    v, m = _group(mix, rows, rmask, 0, M, N, NP)
    j = tl.arange(0, NP)
    b = tl.load(base + j, mask=j < N, other=0.0)
    sig = _sigmoid(v * tl.load(scale) + b[None, :])
    return tl.where(m, sig + hc_eps, 0.0), sig, v, m


@triton.jit
def _comb_index(N: tl.constexpr, NP: tl.constexpr):
    """``j * n + k`` and the valid mask of a padded ``[NP, NP]`` comb matrix."""
    j = tl.arange(0, NP)[:, None]
    k = tl.arange(0, NP)[None, :]
    return j * N + k, (j < N) & (k < N)


@triton.jit
def _comb_softmax(mix, base, scale, rows, rmask, M: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
    """Comb logits ``[BT, NP, NP]``, their softmax over ``k`` (0 on padding), the row-and-valid mask and the
    valid mask."""
    jk, valid = _comb_index(N, NP)
    m3 = rmask[:, None, None] & valid[None, :, :]
    v = tl.load(mix + rows[:, None, None] * M + 2 * N + jk[None, :, :], mask=m3, other=0.0)
    b = tl.load(base + 2 * N + jk, mask=valid, other=0.0)
    logit = tl.where(valid[None, :, :], v * tl.load(scale + 2) + b[None, :, :], float("-inf"))
    mx = tl.max(logit, axis=2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # padded rows j >= n
    ex = tl.exp(logit - mx[:, :, None])
    den = tl.sum(ex, axis=2)
    den = tl.where(den == 0.0, 1.0, den)
    return v, ex / den[:, :, None], m3, valid


@triton.jit
def _col_norm(p, eps):
    return p / (tl.sum(p, axis=1)[:, None, :] + eps)


@triton.jit
def _row_norm(p, eps):
    return p / (tl.sum(p, axis=2)[:, :, None] + eps)


@triton.jit
def _col_norm_bwd(p, dy, eps, valid):
    """Gradient into ``p`` of ``y = p / (sum_j p + eps)``: ``(dy - sum_j dy y) / den`` (kept 0 on padding,
    where ``den = eps`` would blow the padded entries up)."""
    den = tl.sum(p, axis=1)[:, None, :] + eps
    y = p / den
    return tl.where(valid[None, :, :], (dy - tl.sum(dy * y, axis=1)[:, None, :]) / den, 0.0)


@triton.jit
def _row_norm_bwd(p, dy, eps, valid):
    den = tl.sum(p, axis=2)[:, :, None] + eps
    y = p / den
    return tl.where(valid[None, :, :], (dy - tl.sum(dy * y, axis=2)[:, :, None]) / den, 0.0)


# ---------------------------------------------------------------------------------------------- pre-mapping
@triton.jit
def hc_pre_fwd_kernel(x, fn, base, scale, mix, rstd, post, comb, out, T, norm_eps, hc_eps,
                      N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                      MP: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    cdt: tl.constexpr = fn.dtype.element_ty
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    cm = cols < M
    acc = tl.zeros((BT, MP), dtype=cdt)
    ss = tl.zeros((BT,), dtype=cdt)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < K
        xt = tl.load(x + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        ft = tl.load(fn + cols[:, None] * K + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        xc = xt.to(cdt)
        ss += tl.sum(xc * xc, axis=1)
        if SPLIT:
            xo = _mma_operand(xt, cdt, SPLIT, INTERP)
            fh, fm, fl = _split3(ft, INTERP)
            # one k tile on the tensor cores (smallest parts first), the tiles summed here in IEEE fp32
            part = tl.dot(xo, tl.trans(fl))
            part = tl.dot(xo, tl.trans(fm), part)
            acc += tl.dot(xo, tl.trans(fh), part)
        else:
            acc = tl.dot(xc, tl.trans(ft), acc, input_precision="ieee")
    r = 1.0 / tl.sqrt(ss / K + norm_eps)
    tl.store(mix + rows[:, None] * M + cols[None, :], acc * r[:, None], mask=rmask[:, None] & cm[None, :])
    tl.store(rstd + rows, r, mask=rmask)
    # The groups are read back from the stored logits: one [BT, M] row splits into pre / post / comb tiles.
    tl.debug_barrier()
    pre, _, _, _ = _pre_weights(mix, base, scale, rows, rmask, hc_eps, M, N, NP)
    jj = tl.arange(0, NP)
    if not HEAD:
        pv, pm = _group(mix, rows, rmask, N, M, N, NP)
        bp = tl.load(base + N + jj, mask=jj < N, other=0.0)
        tl.store(post + rows[:, None] * N + jj[None, :], 2.0 * _sigmoid(pv * tl.load(scale + 1) + bp[None, :]),
                 mask=pm)
        _, sm, m3, valid = _comb_softmax(mix, base, scale, rows, rmask, M, N, NP)
        p = _col_norm(tl.where(valid[None, :, :], sm + hc_eps, 0.0), hc_eps)
        for _ in range(ITERS - 1):
            p = _col_norm(_row_norm(p, hc_eps), hc_eps)
        jk, _ = _comb_index(N, NP)
        tl.store(comb + rows[:, None, None] * (N * N) + jk[None, :, :], p, mask=m3)
    _collapse(x, pre, out, rows, rmask, cdt, N, NP, D, K, BT, BD)


@triton.jit
def _collapse(x, pre, out, rows, rmask, cdt: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr,
              K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``out[rows] = sum_j pre_j X_j`` in ``cdt``, rounded once; the one place this sum is written, so that the
    backward's recomputation (:func:`hc_collapse_kernel`) gives the forward's bits."""
    jj = tl.arange(0, NP)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        m2 = rmask[:, None] & (ds < D)[None, :]
        o = tl.zeros((BT, BD), dtype=cdt)
        for j in tl.static_range(N):
            pj = tl.sum(tl.where(jj[None, :] == j, pre, 0.0), axis=1)
            o += pj[:, None] * tl.load(x + rows[:, None] * K + j * D + ds[None, :], mask=m2, other=0.0).to(cdt)
        tl.store(out + rows[:, None] * D + ds[None, :], o.to(out.dtype.element_ty), mask=m2)


@triton.jit
def hc_collapse_kernel(x, mix, base, scale, out, T, hc_eps, N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr,
                       K: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """The forward's collapse again from the saved logits (the fused RMSNorm's backward needs its input)."""
    cdt: tl.constexpr = mix.dtype.element_ty
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows = rows.to(tl.int64)
    pre, _, _, _ = _pre_weights(mix, base, scale, rows, rmask, hc_eps, M, N, NP)
    _collapse(x, pre, out, rows, rmask, cdt, N, NP, D, K, BT, BD)


@triton.jit
def hc_pre_bwd_coef_kernel(x, dout, dpost, dcomb, mix, rstd, base, scale, g, e, pre_out, part_base, part_scale,
                           scratch, T, row0, hc_eps,
                           N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                           MP: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, BT: tl.constexpr,
                           BD: tl.constexpr):
    cdt: tl.constexpr = mix.dtype.element_ty
    local = tl.program_id(0) * BT + tl.arange(0, BT)
    blk = row0 // BT + tl.program_id(0)
    rows = row0 + local
    rmask = rows < T
    rows = rows.to(tl.int64)
    jj = tl.arange(0, NP)
    # dpre_j = sum_d dcollapsed[d] * X_j[d]
    dpre = tl.zeros((BT, NP), dtype=cdt)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        m2 = rmask[:, None] & (ds < D)[None, :]
        go = tl.load(dout + rows[:, None] * D + ds[None, :], mask=m2, other=0.0).to(cdt)
        for j in tl.static_range(N):
            xj = tl.load(x + rows[:, None] * K + j * D + ds[None, :], mask=m2, other=0.0).to(cdt)
            dpre += tl.where(jj[None, :] == j, tl.sum(go * xj, axis=1)[:, None], 0.0)
    pre, sig, v0, m0 = _pre_weights(mix, base, scale, rows, rmask, hc_eps, M, N, NP)
    tl.store(pre_out + rows[:, None] * N + jj[None, :], pre, mask=m0)
    r = tl.load(rstd + rows, mask=rmask, other=0.0)
    dl = tl.where(m0, dpre * sig * (1.0 - sig), 0.0)  # d logit (before scale and base)
    dm = dl * tl.load(scale)  # d mix
    crow = tl.sum(dm * v0, axis=1)
    tl.store(g + rows[:, None] * M + jj[None, :], dm * r[:, None], mask=m0)
    tl.store(part_base + blk * MP + jj, tl.sum(dl, axis=0), mask=jj < N)
    tl.store(part_scale + blk * MP + jj, tl.sum(dl * v0, axis=0), mask=jj < N)
    if not HEAD:
        v1, m1 = _group(mix, rows, rmask, N, M, N, NP)
        bp = tl.load(base + N + jj, mask=jj < N, other=0.0)
        s1 = tl.load(scale + 1)
        sp = _sigmoid(v1 * s1 + bp[None, :])
        gp = tl.load(dpost + rows[:, None] * N + jj[None, :], mask=m1, other=0.0).to(cdt)
        dl = tl.where(m1, 2.0 * gp * sp * (1.0 - sp), 0.0)
        dm = dl * s1
        crow += tl.sum(dm * v1, axis=1)
        tl.store(g + rows[:, None] * M + N + jj[None, :], dm * r[:, None], mask=m1)
        tl.store(part_base + blk * MP + N + jj, tl.sum(dl, axis=0), mask=jj < N)
        tl.store(part_scale + blk * MP + N + jj, tl.sum(dl * v1, axis=0), mask=jj < N)

        # Sinkhorn: rerun the rounds keeping each normalization's input, then their backward in reverse.
        v2, sm, m3, valid = _comb_softmax(mix, base, scale, rows, rmask, M, N, NP)
        jk, _ = _comb_index(N, NP)
        NN: tl.constexpr = NP * NP
        S: tl.constexpr = 2 * ITERS - 1
        jp = tl.arange(0, NP)
        slot = scratch + local.to(tl.int64)[:, None, None] * (S * NN) + (jp[:, None] * NP + jp[None, :])[None, :, :]
        smask = rmask[:, None, None] & (jp[:, None] < NP)[None, :, :]
        p = tl.where(valid[None, :, :], sm + hc_eps, 0.0)
        tl.store(slot, p, mask=smask)
        p = _col_norm(p, hc_eps)
        for it in range(1, ITERS):
            tl.store(slot + (2 * it - 1) * NN, p, mask=smask)
            p = _row_norm(p, hc_eps)
            tl.store(slot + (2 * it) * NN, p, mask=smask)
            p = _col_norm(p, hc_eps)
        tl.debug_barrier()
        dp = tl.load(dcomb + rows[:, None, None] * (N * N) + jk[None, :, :], mask=m3, other=0.0).to(cdt)
        for i in range(ITERS - 1):
            it = ITERS - 1 - i
            dp = _col_norm_bwd(tl.load(slot + (2 * it) * NN, mask=smask, other=0.0), dp, hc_eps, valid)
            dp = _row_norm_bwd(tl.load(slot + (2 * it - 1) * NN, mask=smask, other=0.0), dp, hc_eps, valid)
        dp = _col_norm_bwd(tl.load(slot, mask=smask, other=0.0), dp, hc_eps, valid)
        dl3 = tl.where(m3, sm * (dp - tl.sum(dp * sm, axis=2)[:, :, None]), 0.0)  # softmax backward
        dm3 = dl3 * tl.load(scale + 2)
        crow += tl.sum(tl.sum(dm3 * v2, axis=2), axis=1)
        tl.store(g + rows[:, None, None] * M + 2 * N + jk[None, :, :], dm3 * r[:, None, None], mask=m3)
        tl.store(part_base + blk * MP + 2 * N + jk, tl.sum(dl3, axis=0), mask=valid)
        tl.store(part_scale + blk * MP + 2 * N + jk, tl.sum(dl3 * v2, axis=0), mask=valid)
    tl.store(e + rows, crow * r * r / K, mask=rmask)


@triton.jit
def hc_pre_bwd_stream_kernel(x, dout, fn, g, e, pre, dxin, dx, T,
                             N: tl.constexpr, D: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                             MP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                             HAS_DXIN: tl.constexpr, INTERP: tl.constexpr):
    cdt: tl.constexpr = g.dtype.element_ty
    ks = tl.program_id(0) * BK + tl.arange(0, BK)
    km = ks < K
    rows = tl.program_id(1) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    cm = cols < M
    m2 = rmask[:, None] & km[None, :]
    ft = tl.load(fn + cols[:, None] * K + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0)
    gt = tl.load(g + rows[:, None] * M + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
    if SPLIT:
        # dX to bf16 needs ~16 bits of g @ fn: the three leading part products, on the tensor cores
        fh, fm, fl = _split3(ft, INTERP)
        gh, gm, gl = _split3(gt, INTERP)
        dot = tl.dot(gm, fh, tl.dot(gh, fm, tl.dot(gh, fh)))
    else:
        dot = tl.dot(gt, ft, input_precision="ieee")
    stream = ks // D
    ch = ks - stream * D
    xc = tl.load(x + rows[:, None] * K + ks[None, :], mask=m2, other=0.0).to(cdt)
    pj = tl.load(pre + rows[:, None] * N + stream[None, :], mask=m2, other=0.0)
    go = tl.load(dout + rows[:, None] * D + ch[None, :], mask=m2, other=0.0).to(cdt)
    et = tl.load(e + rows, mask=rmask, other=0.0)
    val = dot - et[:, None] * xc + pj * go
    if HAS_DXIN:  # the streams' other gradient (the site's combine), added before the one rounding
        val += tl.load(dxin + rows[:, None] * K + ks[None, :], mask=m2, other=0.0).to(cdt)
    tl.store(dx + rows[:, None] * K + ks[None, :], val.to(dx.dtype.element_ty), mask=m2)


def _fn_grad(g: Tensor, streams: Tensor) -> Tensor:
    """``dfn = g^T @ X`` (``[M, K]``, fp32 sums over the rows) as one GEMM. bf16 streams on CUDA meet ``g`` split
    into three bf16 parts (``hi + mid + lo`` holds its 24 bits: every product exact) in one ``[3M, T] @ [T, K]``
    product with fp32 output; other streams are multiplied in ``g``'s dtype. Every row takes part: ``[0, K]`` rows
    give zeros."""
    t, n, d = streams.shape
    x = streams.reshape(t, n * d)
    if streams.dtype != torch.bfloat16:
        return g.t() @ x.to(g.dtype)
    hi = g.to(torch.bfloat16)
    r = g - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    parts = torch.cat([hi, mid, lo], dim=1)  # [T, 3M]
    if streams.is_cuda:
        prod = torch.mm(parts.t(), x, out_dtype=torch.float32)
    else:  # the CPU has no bf16 GEMM with fp32 output: the same exact products in fp32
        prod = parts.t().float() @ x.float()
    return prod.view(3, g.shape[1], n * d).sum(0).to(g.dtype)


# ---------------------------------------------------------------------------------------------- combine
@triton.jit
def hc_combine_fwd_kernel(x, y, post, comb, out, T, N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr,
                          K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    cdt: tl.constexpr = post.dtype.element_ty
    xdt: tl.constexpr = x.dtype.element_ty
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows = rows.to(tl.int64)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    m2 = rmask[:, None] & (ds < D)[None, :]
    kk = tl.arange(0, NP)
    pm = rmask[:, None] & (kk < N)[None, :]
    # post / comb rounded to the stream dtype, as the reference casts them
    pst = tl.load(post + rows[:, None] * N + kk[None, :], mask=pm, other=0.0).to(xdt).to(cdt)
    yt = tl.load(y + rows[:, None] * D + ds[None, :], mask=m2, other=0.0).to(cdt)
    acc = pst[:, :, None] * yt[:, None, :]
    for j in tl.static_range(N):
        cj = tl.load(comb + rows[:, None] * (N * N) + j * N + kk[None, :], mask=pm, other=0.0).to(xdt).to(cdt)
        xj = tl.load(x + rows[:, None] * K + j * D + ds[None, :], mask=m2, other=0.0).to(cdt)
        acc += cj[:, :, None] * xj[:, None, :]
    off = rows[:, None, None] * K + kk[None, :, None] * D + ds[None, None, :]
    tl.store(out + off, acc.to(out.dtype.element_ty), mask=pm[:, :, None] & (ds < D)[None, None, :])


@triton.jit
def hc_combine_bwd_kernel(x, y, post, comb, dout, dx, dy, dpost, dcomb, T, N: tl.constexpr, NP: tl.constexpr,
                          D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    cdt: tl.constexpr = post.dtype.element_ty
    xdt: tl.constexpr = x.dtype.element_ty
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows = rows.to(tl.int64)
    kk = tl.arange(0, NP)
    pm = rmask[:, None] & (kk < N)[None, :]
    pst = tl.load(post + rows[:, None] * N + kk[None, :], mask=pm, other=0.0).to(xdt).to(cdt)
    dpost_acc = tl.zeros((BT, NP), dtype=cdt)
    dcomb_acc = tl.zeros((BT, NP, NP), dtype=cdt)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < D
        m2 = rmask[:, None] & dm[None, :]
        m3 = pm[:, :, None] & dm[None, None, :]
        go = tl.load(dout + rows[:, None, None] * K + kk[None, :, None] * D + ds[None, None, :], mask=m3,
                     other=0.0).to(cdt)  # [BT, k, BD]
        yt = tl.load(y + rows[:, None] * D + ds[None, :], mask=m2, other=0.0).to(cdt)
        dpost_acc += tl.sum(go * yt[:, None, :], axis=2)
        tl.store(dy + rows[:, None] * D + ds[None, :], tl.sum(pst[:, :, None] * go, axis=1).to(dy.dtype.element_ty),
                 mask=m2)
        for j in tl.static_range(N):
            cj = tl.load(comb + rows[:, None] * (N * N) + j * N + kk[None, :], mask=pm, other=0.0).to(xdt).to(cdt)
            xj = tl.load(x + rows[:, None] * K + j * D + ds[None, :], mask=m2, other=0.0).to(cdt)
            tl.store(dx + rows[:, None] * K + j * D + ds[None, :],
                     tl.sum(cj[:, :, None] * go, axis=1).to(dx.dtype.element_ty), mask=m2)
            dcj = tl.sum(go * xj[:, None, :], axis=2)  # [BT, k]
            dcomb_acc += tl.where((kk == j)[None, :, None], dcj[:, None, :], 0.0)
    tl.store(dpost + rows[:, None] * N + kk[None, :], dpost_acc, mask=pm)
    jk, valid = _comb_index(N, NP)
    tl.store(dcomb + rows[:, None, None] * (N * N) + jk[None, :, :], dcomb_acc,
             mask=rmask[:, None, None] & valid[None, :, :])


# ---------------------------------------------------------------------------------------------- host side
def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the kernels fill (the tests swap this for NaN-filled ones: an unwritten element fails)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _interp(t: Tensor) -> bool:
    return t.device.type == "cpu" or interpreting()


def _geometry(streams: Tensor, width: int) -> dict:
    _, n, d = streams.shape
    return dict(N=n, NP=triton.next_power_of_2(n), D=d, K=n * d, M=width, MP=max(16, triton.next_power_of_2(width)))


def _split(streams: Tensor, flag: int) -> bool:
    return bool(flag) and streams.dtype == torch.bfloat16


def _pre_forward(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float,
                 norm_eps: float, head: bool, cfg: MhcConfig):
    t, n, d = streams.shape
    cdt = fn.dtype
    geo = _geometry(streams, fn.shape[0])
    dev = streams.device
    mix = _empty((t, geo["M"]), cdt, dev)
    rstd = _empty((t,), cdt, dev)
    post = _empty((t, n) if not head else (0,), cdt, dev)
    comb = _empty((t, n, n), cdt, dev) if not head else _empty((0,), cdt, dev)
    out = _empty((t, d), streams.dtype, dev)
    if t:
        bt = cfg.fwd_rows
        if streams.is_cuda and triton.cdiv(t, bt) < sm_count(streams.device):
            bt = cfg.fwd_rows_small  # fill the SMs at a few thousand rows
        split = _split(streams, cfg.fwd_split)
        hc_pre_fwd_kernel[(triton.cdiv(t, bt),)](
            streams, fn, base, scale, mix, rstd, post, comb, out, t, norm_eps, hc_eps, **geo, ITERS=iters,
            HEAD=head, BT=bt, BK=cfg.fwd_k if split else cfg.fwd_k_fma,
            BD=min(cfg.fwd_d, triton.next_power_of_2(d)), SPLIT=split, INTERP=_interp(streams),
            num_warps=cfg.fwd_warps)
    return post, comb, out, mix, rstd


def _pre_backward(streams, fn, base, scale, mix, rstd, dout, dpost, dcomb, iters: int, hc_eps: float, head: bool,
                  cfg: MhcConfig, dx_in: Tensor | None = None):
    """The site's gradients; ``dx_in`` (the streams' gradient from another consumer) is added into ``dx``."""
    t, n, d = streams.shape
    cdt = fn.dtype
    geo = _geometry(streams, fn.shape[0])
    dev = streams.device
    bt = cfg.coef_rows
    blocks = triton.cdiv(t, bt)
    g = _empty(mix.shape, cdt, dev)
    e = _empty((t,), cdt, dev)
    pre = _empty((t, n), cdt, dev)
    # columns past M are never written and never read
    part_base = _empty((blocks, geo["MP"]), cdt, dev)
    part_scale = _empty((blocks, geo["MP"]), cdt, dev)
    steps = 2 * iters - 1
    chunk = max(cfg.scratch_rows // bt, 1) * bt
    scratch = _empty((0 if head else min(chunk, t), steps * geo["NP"] ** 2), cdt, dev)
    if head:
        dpost = dcomb = mix  # not read
    for row0 in range(0, t, chunk):
        rows = min(chunk, t - row0)
        hc_pre_bwd_coef_kernel[(triton.cdiv(rows, bt),)](
            streams, dout, dpost, dcomb, mix, rstd, base, scale, g, e, pre, part_base, part_scale, scratch, t, row0,
            hc_eps, **geo, ITERS=iters, HEAD=head, BT=bt, BD=min(cfg.coef_d, triton.next_power_of_2(d)),
            num_warps=cfg.coef_warps)
    dx = _empty(streams.shape, streams.dtype, dev)
    bt2, bk = cfg.bwd_rows, cfg.bwd_k
    if t:
        hc_pre_bwd_stream_kernel[(triton.cdiv(geo["K"], bk), triton.cdiv(t, bt2))](
            streams, dout, fn, g, e, pre, streams if dx_in is None else dx_in, dx, t, N=n, D=d,
            K=geo["K"], M=geo["M"], MP=geo["MP"], BT=bt2, BK=bk, SPLIT=_split(streams, cfg.bwd_split),
            HAS_DXIN=dx_in is not None, INTERP=_interp(streams), num_warps=cfg.bwd_warps)
    dfn = _fn_grad(g, streams)
    dbase = part_base.sum(0)[:geo["M"]]
    by_col = part_scale.sum(0)
    if head:
        dscale = by_col[:n].sum().reshape(1)
    else:
        dscale = torch.stack([by_col[:n].sum(), by_col[n:2 * n].sum(), by_col[2 * n:geo["M"]].sum()])
    return dx, dfn, dbase, dscale


def _collapse_again(streams: Tensor, mix: Tensor, base: Tensor, scale: Tensor, hc_eps: float,
                    cfg: MhcConfig) -> Tensor:
    """The forward's ``collapsed [T, D]``, bit for bit, from the streams and the saved logits (one read of the
    streams): what the fused RMSNorm's backward needs, recomputed instead of kept."""
    t, n, d = streams.shape
    out = _empty((t, d), streams.dtype, streams.device)
    if t:
        bt, bd = cfg.collapse_rows, min(cfg.collapse_d, triton.next_power_of_2(d))
        hc_collapse_kernel[(triton.cdiv(t, bt),)](
            streams, mix, base, scale, out, t, hc_eps, N=n, NP=triton.next_power_of_2(n), D=d, K=n * d,
            M=mix.shape[1], BT=bt, BD=bd, num_warps=cfg.collapse_warps)
    return out


class _Collapse:
    """The collapse a site's rebuilt input was normed from, handed to that site's backward (whose RMSNorm backward
    needs exactly it) so that it is computed once in the backward, not twice."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def take(self) -> Tensor | None:
        value, self.value = self.value, None
        return value


def _input_again(streams: Tensor, mix: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_w: Tensor | None,
                 rms_eps: float, cfg: MhcConfig, shared: _Collapse | None = None) -> Tensor:
    """A site's third output again, bit for bit: the collapse from the logits, then the same RMSNorm; the collapse
    waits in ``shared`` for the site's backward (``streams`` are the site's, or a bit-identical copy)."""
    cdt = mix.dtype
    streams = streams.detach().contiguous()
    out = _collapse_again(streams, mix, base.to(cdt).contiguous(), scale.to(cdt).contiguous(), hc_eps, cfg)
    if norm_w is None:
        return out
    if shared is not None:
        shared.value = out
    return rms_norm_forward(out, norm_w, rms_eps)[0]


class _HcPre(torch.autograd.Function):
    """One site (or the head): the logits, weights and collapse; with ``norm_w`` also the RMSNorm of the
    collapse, whose input is then recomputed in the backward instead of kept (the site keeps the streams, the
    logits and two scales per row)."""

    @staticmethod
    def forward(ctx, streams, fn, base, scale, iters, hc_eps, norm_eps, head, cfg, norm_w=None, rms_eps=0.0,
                shared=None):
        cdt = torch.promote_types(streams.dtype, torch.float32)
        fn_c, base_c, scale_c = fn.to(cdt).contiguous(), base.to(cdt).contiguous(), scale.to(cdt).contiguous()
        post, comb, out, mix, rstd = _pre_forward(streams, fn_c, base_c, scale_c, iters, hc_eps, norm_eps, head,
                                                  cfg)
        saved = [streams, fn, base, scale, mix, rstd]
        if norm_w is not None:
            out, norm_rstd = rms_norm_forward(out, norm_w, rms_eps)
            saved += [norm_w, norm_rstd]
        ctx.save_for_backward(*saved)
        ctx.cfg = (iters, hc_eps, head, norm_w is not None, cfg)
        ctx.shared = shared
        if head:
            return out
        ctx.mark_non_differentiable(mix)
        # the logits for a caller that rebuilds ``out`` (:func:`_input_again`), and the streams again (autograd
        # makes it a view): a combine that reads this alias sends its stream gradient here, into the one pass
        # that writes the site's own (no separate sum of the two)
        return post, comb, out, mix, streams

    @staticmethod
    def backward(ctx, *grads):
        streams, fn, base, scale, mix, rstd, *norm = ctx.saved_tensors
        iters, hc_eps, head, fused_norm, cfg = ctx.cfg
        cdt = mix.dtype
        dx_in = None
        if head:
            (dout,), dpost, dcomb = grads, None, None
        else:
            dpost, dcomb, dout, _, dx_in = grads
            dpost, dcomb = dpost.to(cdt).contiguous(), dcomb.to(cdt).contiguous()
            dx_in = None if dx_in is None else dx_in.contiguous()
        fn_c, base_c, scale_c = fn.to(cdt).contiguous(), base.to(cdt).contiguous(), scale.to(cdt).contiguous()
        dnorm_w = None
        if fused_norm:
            norm_w, norm_rstd = norm
            collapsed = ctx.shared.take() if ctx.shared is not None else None
            if collapsed is None:
                collapsed = _collapse_again(streams, mix, base_c, scale_c, hc_eps, cfg)
            dout, dnorm_w = rms_norm_backward(collapsed, norm_w, norm_rstd, dout, True, ctx.needs_input_grad[9])
            del collapsed
        dx, dfn, dbase, dscale = _pre_backward(streams, fn_c, base_c, scale_c, mix, rstd, dout.contiguous(), dpost,
                                               dcomb, iters, hc_eps, head, cfg, dx_in)
        return _HcPreGrads(streams=dx, fn=dfn.to(fn.dtype), base=dbase.to(base.dtype), scale=dscale.to(scale.dtype),
                           norm_w=dnorm_w)


_HcPreGrads = named_grads(_HcPre)


class _HcCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, y, post, comb, cfg):
        t, n, d = streams.shape
        out = _empty((t, n, d), torch.promote_types(streams.dtype, y.dtype), streams.device)
        if t:
            bt, bd = cfg.comb_rows, min(cfg.comb_d, triton.next_power_of_2(d))
            hc_combine_fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
                streams, y, post, comb, out, t, N=n, NP=triton.next_power_of_2(n), D=d, K=n * d, BT=bt, BD=bd,
                num_warps=cfg.comb_warps)
        ctx.save_for_backward(streams, y, post, comb)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        streams, y, post, comb = ctx.saved_tensors
        cfg = ctx.cfg
        t, n, d = streams.shape
        dx, dy = _empty(streams.shape, streams.dtype, streams.device), _empty(y.shape, y.dtype, y.device)
        dpost, dcomb = _empty(post.shape, post.dtype, post.device), _empty(comb.shape, comb.dtype, comb.device)
        if t:
            bt, bd = cfg.comb_rows, min(cfg.comb_d, triton.next_power_of_2(d))
            hc_combine_bwd_kernel[(triton.cdiv(t, bt),)](
                streams, y, post, comb, dout.contiguous(), dx, dy, dpost, dcomb, t, N=n, NP=triton.next_power_of_2(n),
                D=d, K=n * d, BT=bt, BD=bd, num_warps=cfg.comb_warps)
        return dx, dy, dpost, dcomb, None


def _check_streams(streams: Tensor, fn: Tensor, width: int) -> None:
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], got shape {tuple(streams.shape)}")
    _, n, d = streams.shape
    if fn.shape != (width, n * d):
        raise ValueError(f"fn must be [{width}, {n * d}] for streams {tuple(streams.shape)}, got {tuple(fn.shape)}")


def _check_norm_weight(streams: Tensor, norm_weight: Tensor | None) -> None:
    if norm_weight is not None and norm_weight.shape != (streams.shape[-1],):
        raise ValueError(f"norm_weight must be [D] = [{streams.shape[-1]}] for streams {tuple(streams.shape)}, got "
                         f"{tuple(norm_weight.shape)}")


def hc_site_triton(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, sinkhorn_iters: int, hc_eps: float,
                   norm_eps: float, norm_weight: Tensor | None = None, rms_eps: float = 0.0,
                   config: MhcConfig | None = None) -> tuple:
    """Fused :func:`~csattn.ops.mhc.naive.hc_pre_ref`: ``streams [T, n, D]``, ``fn [(2+n)*n, n*D]``,
    ``base [(2+n)*n]``, ``scale [3]`` -> ``post [T, n]``, ``comb [T, n, n]`` (fp32; fp64 for fp64 streams),
    ``collapsed [T, D]`` (stream dtype), the streams for the site's combine (an alias whose gradient this site's
    backward adds into its own) and ``again(streams)`` (the third output computed again from the streams and the
    logits; see :func:`csattn.ops.mhc.hc_site`). Saves the streams, ``[T, (2+n)*n]`` logits and ``[T]`` rstd.

    With ``norm_weight [D]`` the third output is ``rms_norm(collapsed, norm_weight, rms_eps)`` instead, and the
    collapse is recomputed in the backward rather than kept (one more ``[T]`` scale saved). ``config``: the launch
    settings (:class:`~csattn.ops.mhc.config.MhcConfig`; None: its defaults), kept for the backward."""
    n = streams.shape[-2] if streams.dim() == 3 else 0
    _check_streams(streams, fn, (2 + n) * n)
    if base.shape != (fn.shape[0],) or scale.shape != (3,):
        raise ValueError(f"base must be [{fn.shape[0]}] and scale [3], got {tuple(base.shape)}, {tuple(scale.shape)}")
    _check_norm_weight(streams, norm_weight)
    cfg = config or MhcConfig()
    shared = _Collapse()
    post, comb, out, mix, alias = _HcPre.apply(streams.contiguous(), fn, base, scale, int(sinkhorn_iters),
                                               float(hc_eps), float(norm_eps), False, cfg, norm_weight,
                                               float(rms_eps), shared)
    again = functools.partial(_input_again, mix=mix, base=base.detach(), scale=scale.detach(), hc_eps=float(hc_eps),
                              norm_w=None if norm_weight is None else norm_weight.detach(), rms_eps=float(rms_eps),
                              cfg=cfg, shared=shared)
    return post, comb, out, alias, again


def hc_pre_triton(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, sinkhorn_iters: int, hc_eps: float,
                  norm_eps: float, norm_weight: Tensor | None = None, rms_eps: float = 0.0,
                  config: MhcConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The first three outputs of :func:`hc_site_triton`."""
    return hc_site_triton(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, rms_eps,
                          config)[:3]


def hc_head_triton(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float,
                   norm_weight: Tensor | None = None, rms_eps: float = 0.0, config: MhcConfig | None = None) -> Tensor:
    """Fused :func:`~csattn.ops.mhc.naive.hc_head_ref`: ``streams [T, n, D]``, ``fn [n, n*D]``, ``base [n]``,
    ``scale [1]`` -> ``[T, D]`` (stream dtype); normed by ``norm_weight [D]`` when given (see
    :func:`hc_pre_triton`)."""
    n = streams.shape[-2] if streams.dim() == 3 else 0
    _check_streams(streams, fn, n)
    if base.shape != (n,) or scale.shape != (1,):
        raise ValueError(f"base must be [{n}] and scale [1], got {tuple(base.shape)}, {tuple(scale.shape)}")
    _check_norm_weight(streams, norm_weight)
    return _HcPre.apply(streams.contiguous(), fn, base, scale, 1, float(hc_eps), float(norm_eps), True,
                        config or MhcConfig(), norm_weight, float(rms_eps), None)


def hc_combine_triton(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor,
                      config: MhcConfig | None = None) -> Tensor:
    """Fused :func:`~csattn.ops.mhc.naive.hc_combine_ref`: ``streams [T, n, D]``, ``block_out [T, D]``,
    ``post [T, n]``, ``comb [T, n, n]`` -> ``[T, n, D]``. Saves its four inputs (no copies)."""
    if streams.dim() != 3:
        raise ValueError(f"streams must be [T, n, D], got shape {tuple(streams.shape)}")
    t, n, d = streams.shape
    if block_out.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"block_out [T, D], post [T, n], comb [T, n, n] expected for streams {tuple(streams.shape)}, "
                         f"got {tuple(block_out.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")
    cdt = torch.promote_types(streams.dtype, torch.float32)
    return _HcCombine.apply(streams.contiguous(), block_out.contiguous(), post.to(cdt).contiguous(),
                            comb.to(cdt).contiguous(), config or MhcConfig())

"""Triton kernels of LoRA's rank-``r`` products over expert-sorted rows (``csattn.ops.moe.grouped``): the rank-in
product ``v_e = x[rows of e] w_e`` ``[N, r]`` and the factor gradient ``p_e^T x[rows of e]`` ``[E, r, K]`` (or its
transpose), each reading the wide rows once, **gathered by an index** where the rows are token rows.

Why: the grouped path would first copy ``x[token]`` (``[N, D]``, k times the tokens) only to feed these skinny
products, and gather ``dout[token]`` again in the backward; with frozen FP8 experts nothing else takes those bf16
rows (the expert GEMMs take their rows quantized before the gather). Here each program reads its rows through the
index. The factor gradient sums a group's rows in one program (no atomics: deterministic), zeros for an empty
group.

Tiles of the rank-in product find their group as the grouped kernels' do (:func:`csattn.ops.fp8.triton
._group_of_tile`); rows past ``offs[-1]`` get zeros. Same math as the ``grouped_mm`` path of
:mod:`csattn.ops.moe.grouped` (fp32 accumulation, one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting, sm_count
from ..fp8.triton import _group_of_tile

__all__ = ["rank_in_triton", "rank_grad_triton"]


@triton.jit
def _rank_in_kernel(x, index, w, offs, out, M, K, E, R, stride_xm, stride_we, stride_wk, stride_wr, stride_om,
                    HAS_INDEX: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr):
    g, row0, row_end = _group_of_tile(offs, tl.program_id(0), M, E, BM, E_P2)
    if g > E:  # no tile
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    src = tl.load(index + rows, mask=rmask, other=0) if HAS_INDEX else rows
    src = src.to(tl.int64)
    ks = tl.arange(0, BR)
    kmask = ks < R
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for k0 in range(0, tl.where(g < E, K, 0), BK):  # the rows past offs[-1] (group E): zeros
        cols = k0 + tl.arange(0, BK)
        cmask = cols < K
        xt = tl.load(x + src[:, None] * stride_xm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        wt = tl.load(w + g.to(tl.int64) * stride_we + cols[:, None] * stride_wk + ks[None, :] * stride_wr,
                     mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(xt, wt, input_precision="ieee")  # fp32 operands exactly, not in TF32
    tl.store(out + rows.to(tl.int64)[:, None] * stride_om + ks[None, :], acc.to(out.dtype.element_ty),
             mask=rmask[:, None] & kmask[None, :])


def rank_in_triton(x: Tensor, w: Tensor, offs: Tensor, index: Tensor | None = None) -> Tensor:
    """``out [N, r]``: row ``m`` of group ``e`` is ``x[index[m]] @ w[e]`` (``x [*, K]``, rows ``index [N]`` int64,
    or the first ``N = offs[-1]`` rows of ``x`` in order without ``index``; ``w [E, K, r]``, any strides); rows past
    ``offs[-1]`` are zero. fp32 accumulation, one rounding to ``x``'s dtype."""
    n = index.shape[0] if index is not None else x.shape[0]
    k, (e, _, r) = x.shape[1], w.shape
    out = torch.empty((n, r), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    bm, bk = (16, 32) if interpreting() else (64, 128)
    grid = (triton.cdiv(n, bm) + e + 1,)
    _rank_in_kernel[grid](x, x if index is None else index, w, offs, out, n, k, e, r, x.stride(0), *w.stride(),
                          out.stride(0), HAS_INDEX=index is not None, E_P2=triton.next_power_of_2(e + 2), BM=bm,
                          BK=bk, BR=max(16, triton.next_power_of_2(r)), num_warps=4)
    return out


@triton.jit
def _rank_grad_kernel(p, x, index, offs, out, K, R, scale, SPLIT, stride_pm, stride_xm, stride_os, stride_oe,
                      stride_or, stride_ok, HAS_INDEX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    end = tl.load(offs + e)
    # part program_id(2) of SPLIT of the group's rows (whole blocks of BM)
    part = tl.cdiv(tl.cdiv(tl.maximum(end - start, 0), SPLIT), BM) * BM
    lo = start + tl.program_id(2) * part
    hi = tl.minimum(end, lo + part)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    cmask = cols < K
    ks = tl.arange(0, BR)
    kmask = ks < R
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for m0 in range(lo, hi, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < hi
        src = tl.load(index + rows, mask=rmask, other=0) if HAS_INDEX else rows
        src = src.to(tl.int64)
        pt = tl.load(p + rows.to(tl.int64)[:, None] * stride_pm + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                     other=0.0)
        xt = tl.load(x + src[:, None] * stride_xm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(tl.trans(pt), xt, input_precision="ieee")
    dest = out + tl.program_id(2).to(tl.int64) * stride_os + e.to(tl.int64) * stride_oe
    tl.store(dest + ks[:, None] * stride_or + cols[None, :] * stride_ok, (acc * scale).to(out.dtype.element_ty),
             mask=kmask[:, None] & cmask[None, :])


def rank_grad_triton(p: Tensor, x: Tensor, offs: Tensor, scale: float, index: Tensor | None = None,
                     transpose: bool = False, split: int | None = None) -> Tensor:
    """``out[e] = scale * p[rows of e]^T @ x[index[rows of e]]`` ``[E, r, K]`` (``transpose``: ``[E, K, r]``), ``p
    [N, r]``, ``x`` as :func:`rank_in_triton`; zeros for an empty group. fp32 sums, one rounding to ``p``'s dtype:
    LoRA's factor gradients (``da_e = scale (dy b)_e^T v_e``, ``db_e = scale dy_e^T (v a^T)_e``).

    A program sums a group's rows for ``BK`` columns; where that gives few programs (a few large groups: the
    shared expert is one) the rows are cut into ``split`` parts (default: enough for two programs an SM), summed
    in fp32 partials and then over the parts in order (deterministic)."""
    e, r, k = offs.shape[0], p.shape[1], x.shape[1]
    shape = (e, k, r) if transpose else (e, r, k)
    if e == 0 or k == 0:
        return torch.empty(shape, dtype=p.dtype, device=p.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = p.contiguous()
    bm, bk = (16, 32) if interpreting() else (64, 128)
    tiles = e * triton.cdiv(k, bk)
    if split is None:
        want = 1 if interpreting() else triton.cdiv(2 * sm_count(p.device), tiles)
        split = max(1, min(want, triton.cdiv(p.shape[0], e * bm)))  # no part shorter than a block on average
    out = torch.empty((split, *shape) if split > 1 else shape, dtype=torch.float32 if split > 1 else p.dtype,
                      device=p.device)
    s_or, s_ok = (1, r) if transpose else (k, 1)
    _rank_grad_kernel[(e, triton.cdiv(k, bk), split)](
        p, x, x if index is None else index, offs, out, k, r, float(scale), split, p.stride(0), x.stride(0),
        e * k * r, k * r, s_or, s_ok, HAS_INDEX=index is not None, BM=bm, BK=bk,
        BR=max(16, triton.next_power_of_2(r)), num_warps=4)
    return out.sum(0).to(p.dtype) if split > 1 else out

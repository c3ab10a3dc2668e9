"""RMSNorm forward and backward as Triton kernels: one read of the rows and one write each way.

Why: the PyTorch form (:mod:`csattn.ops.rms_norm`) runs five or six elementwise kernels over fp32 copies of its
input in each direction, and a layer of the V4-Flash geometry runs twelve norms (the mHC sites' and the final
ones ``[T, 4096]``, the query latent's ``[T, 1024]``, the K = V rows' ``[T, 512]``). Same math: fp32 (fp64 for
fp64 rows), ``w * (x * rsqrt(mean(x^2) + eps))`` rounded once.

- forward, one program per row: ``rstd`` and the normed row;
- backward, ``P`` programs each looping over rows ``p, p + P, ...``: ``dx = r (g w) - x r^3 mean(g w x)`` per row,
  and the weight gradient ``sum_rows g (x r)`` summed in registers, one ``[C]`` partial per program, added on the
  host side in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import sm_count

__all__ = ["rms_norm_fwd_triton", "rms_norm_bwd_triton", "MAX_CHANNELS"]

MAX_CHANNELS = 16384  # a row (and a weight-gradient partial) in registers; wider rows take the PyTorch path


@triton.jit
def _rms_fwd_kernel(x, w, out, rstd, C, eps, BC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BC)
    m = cols < C
    cdt: tl.constexpr = rstd.dtype.element_ty
    h = tl.load(x + row * C + cols, mask=m, other=0.0).to(cdt)
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / C + eps)
    wv = tl.load(w + cols, mask=m, other=0.0).to(cdt)
    tl.store(out + row * C + cols, (wv * (h * r)).to(out.dtype.element_ty), mask=m)
    tl.store(rstd + row, r)


@triton.jit
def _rms_bwd_kernel(x, w, rstd, dy, dx, dw_part, R, C, P, NEED_W: tl.constexpr, BC: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BC)
    m = cols < C
    cdt: tl.constexpr = rstd.dtype.element_ty
    wv = tl.load(w + cols, mask=m, other=0.0).to(cdt)
    acc = tl.zeros((BC,), dtype=cdt)
    pid64 = pid.to(tl.int64)  # row * C overflows int32 past 2^31 elements (512k rows of 4096)
    for i in range(0, tl.cdiv(R - pid, P)):
        row64 = pid64 + i * P
        h = tl.load(x + row64 * C + cols, mask=m, other=0.0).to(cdt)
        g = tl.load(dy + row64 * C + cols, mask=m, other=0.0).to(cdt)
        r = tl.load(rstd + row64)
        gw = g * wv
        d = gw * r + h * (tl.sum(gw * h, axis=0) * (-(r * r * r) / C))
        tl.store(dx + row64 * C + cols, d.to(dx.dtype.element_ty), mask=m)
        if NEED_W:
            acc += g * (h * r)
    if NEED_W:
        tl.store(dw_part + pid.to(tl.int64) * C + cols, acc, mask=m)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the kernels fill (the tests swap this for NaN-filled ones: an unwritten element fails)."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.cache
def _programs(device: torch.device) -> int:
    return 4 * sm_count(device) if device.type == "cuda" else 8


def _warps(bc: int) -> int:
    return max(1, min(16, bc // 512))


def rms_norm_fwd_triton(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x [..., C]`` (C <= MAX_CHANNELS), ``weight [C]`` -> normed rows in ``x.dtype`` and ``rstd [R, 1]`` (fp32;
    fp64 for fp64 rows), as :func:`csattn.ops.rms_norm.rms_norm_forward`."""
    c = x.shape[-1]
    rows = x.reshape(-1, c).contiguous()
    compute = torch.promote_types(x.dtype, torch.float32)
    out = _empty(rows.shape, rows.dtype, x.device)
    rstd = _empty((rows.shape[0], 1), compute, x.device)
    if rows.shape[0]:
        bc = triton.next_power_of_2(c)
        _rms_fwd_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rstd, c, eps, BC=bc, num_warps=_warps(bc))
    return out.view(x.shape), rstd


def rms_norm_bwd_triton(x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, need_x: bool = True,
                        need_w: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """``(dx, dweight)`` as :func:`csattn.ops.rms_norm.rms_norm_backward` (dx is always computed here: the
    weight gradient's pass reads the same rows)."""
    c = x.shape[-1]
    rows, g = x.reshape(-1, c).contiguous(), dy.reshape(-1, c).contiguous()
    r = rows.shape[0]
    dx = _empty(rows.shape, rows.dtype, x.device)
    programs = max(1, min(_programs(x.device), r))
    part = _empty((programs, c), rstd.dtype, x.device)
    if r:
        bc = triton.next_power_of_2(c)
        _rms_bwd_kernel[(programs,)](rows, weight.contiguous(), rstd, g, dx, part, r, c, programs, NEED_W=need_w,
                                     BC=bc, num_warps=_warps(bc))
    dw = None
    if need_w:
        dw = (part.sum(0) if r else torch.zeros(c, dtype=rstd.dtype, device=x.device)).to(weight.dtype)
    return (dx.view(x.shape) if need_x else None), dw

"""Triton kernels of the grouped MoE path: the weighted clamped SwiGLU (forward, and backward with the activation
recomputed from the saved gate/up GEMM output) and the un-permute gather-sum.

Why: in PyTorch the SwiGLU on ``[N, 2I]`` makes a pass per op (casts to fp32, two clamps, sigmoid, three
products, the weight, the cast back; about twice as many in the backward, plus a concatenation of the gate and
up gradients); here each element of ``gu`` is read once and each output written once. The gather-sum reads
the ``k`` rows of every token and sums them in fp32 registers: no atomics (so the result is deterministic and
rounded once, unlike a bf16 ``index_add_``) and no ``[T, k, D]`` temporary. For frozen FP8 experts the SwiGLU
kernels also write their output quantized per 1x128 tile (``fp8_out``: the next FP8 GEMM's input, which would
otherwise take a pass of the quantizer over it), with the quantizer's own arithmetic on the output as rounded
(``csattn.ops.fp8.triton.quantize_tile``), so the bits are the quantizer's.

Same math as :mod:`csattn.ops.moe.naive` (``swiglu_fwd_ref``, ``swiglu_bwd_ref``, ``gather_sum_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting
from ..fp8.grouped import Fp8Rows
from ..fp8.naive import BLOCK, FP8_MAX
from ..fp8.triton import quantize_tile

__all__ = ["swiglu_fwd_triton", "swiglu_bwd_triton", "gather_sum_triton"]

BLOCK_ROWS = 16
BLOCK_COLS = BLOCK  # one 1x128 quantization tile per column block (the fused FP8 outputs)


@triton.jit
def _swiglu_parts(g, u, limit):
    """Clamped up, sigmoid of the clamped gate, silu, activation (one formula for forward and recompute)."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(gc)
    silu = gc * s
    return gc, uc, s, silu, silu * uc


@triton.jit
def _swiglu_fwd_kernel(gu, w, h, q, s, N, I, stride_gu, stride_h, stride_q, stride_sm, stride_sk, limit,
                       BM: tl.constexpr, BN: tl.constexpr, WRITE_H: tl.constexpr, QUANT: tl.constexpr,
                       FP8MAX: tl.constexpr, BY_HAND: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < N
    mask = rmask[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    base = r64 * stride_gu + cols[None, :]
    g = tl.load(gu + base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + base + I, mask=mask, other=0.0).to(tl.float32)
    wr = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)
    _, _, _, _, act = _swiglu_parts(g, u, limit)
    out = (act * wr[:, None]).to(h.dtype.element_ty)  # h's rounding (h is gu when not written: the same dtype)
    if WRITE_H:
        tl.store(h + r64 * stride_h + cols[None, :], out, mask=mask)
    if QUANT:  # h itself quantized (zeros past the data, as the quantizer pads): quantize_1x128(h) bit for bit
        qv, sv = quantize_tile(out.to(tl.float32), FP8MAX, BY_HAND)
        tl.store(q + r64 * stride_q + cols[None, :], qv.to(q.dtype.element_ty), mask=mask)
        tl.store(s + rows.to(tl.int64) * stride_sm + tl.program_id(1) * stride_sk, sv, mask=rmask)


@triton.jit
def _swiglu_bwd_kernel(gu, w, dh, dgu, h, dwp, q, s, N, I, stride_gu, stride_dh, stride_dgu, stride_h, stride_q,
                       stride_sm, stride_sk, stride_dwp, limit, BM: tl.constexpr, BN: tl.constexpr,
                       WRITE_DGU: tl.constexpr, WRITE_H: tl.constexpr, QUANT: tl.constexpr, FP8MAX: tl.constexpr,
                       BY_HAND: tl.constexpr):
    # a program per block of rows and, where it quantizes, of 128 columns; else it loops over all the columns.
    # dw's row sums leave per program in ``dwp [N, programs along I]`` (dw itself where that is one), summed by the
    # launcher in a fixed order (no atomics: deterministic). On an H100 (2dea5ed) the quantizing pass ran 0.845 ms
    # over the blocks against 0.945 looping, the bf16 one (dgu and h written) 0.895 against 0.834
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    r64 = rows.to(tl.int64)[:, None]
    wr = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BM], dtype=tl.float32)
    start = tl.program_id(1) * BN if QUANT else 0
    for c0 in range(start, start + BN if QUANT else I, BN):
        cols = c0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < I)[None, :]
        base = r64 * stride_gu + cols[None, :]
        g = tl.load(gu + base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu + base + I, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dh + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gc, uc, s_, silu, act = _swiglu_parts(g, u, limit)
        if WRITE_H:
            tl.store(h + r64 * stride_h + cols[None, :], (act * wr[:, None]).to(h.dtype.element_ty), mask=mask)
        acc += tl.sum(d * act, axis=1)
        d = d * wr[:, None]
        # clamp passes the gradient inside the closed interval, as torch.clamp's backward does
        dg = tl.where(g <= limit, d * uc * (s_ * (1 + gc * (1 - s_))), 0.0).to(dgu.dtype.element_ty)
        du = tl.where((u >= -limit) & (u <= limit), d * silu, 0.0).to(dgu.dtype.element_ty)
        if WRITE_DGU:
            out = r64 * stride_dgu + cols[None, :]
            tl.store(dgu + out, dg, mask=mask)
            tl.store(dgu + out + I, du, mask=mask)
        if QUANT:  # dgu's gate and up tiles quantized as rounded (I % 128 == 0: each half starts on a tile)
            qo = q + r64 * stride_q + cols[None, :]
            so = s + rows.to(tl.int64) * stride_sm + (c0 // BN) * stride_sk
            qg, sg = quantize_tile(dg.to(tl.float32), FP8MAX, BY_HAND)
            tl.store(qo, qg.to(q.dtype.element_ty), mask=mask)
            tl.store(so, sg, mask=rmask)
            qu, su = quantize_tile(du.to(tl.float32), FP8MAX, BY_HAND)
            tl.store(qo + I, qu.to(q.dtype.element_ty), mask=mask)
            tl.store(so + (I // BN) * stride_sk, su, mask=rmask)
    tl.store(dwp + rows.to(tl.int64) * stride_dwp + tl.program_id(1), acc, mask=rmask)


@triton.jit
def _gather_sum_kernel(src, inv, out, T, D, stride_src, stride_out,
                       K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tmask = toks < T
    mask = tmask[:, None] & (cols < D)[None, :]
    t64 = toks.to(tl.int64)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv + t64 * K + j, mask=tmask, other=0).to(tl.int64)
        acc += tl.load(src + row[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t64[:, None] * stride_out + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


def _check_rows(t: Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with unit column stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _check_fp8_out(fp8_out: tuple[Tensor, Tensor], n: int, cols: int) -> None:
    Fp8Rows(*fp8_out).check("fp8_out", n, cols)
    _check_rows(fp8_out[0], "fp8_out q")


def swiglu_fwd_triton(gu: Tensor, w: Tensor, limit: float, out: Tensor | None = None,
                      fp8_out: tuple[Tensor, Tensor] | None = None, keep_h: bool = True) -> Tensor | None:
    """Triton :func:`~csattn.ops.moe.naive.swiglu_fwd_ref`: ``gu [N, 2I]``, ``w [N]`` -> ``h [N, I]`` (into ``out``
    if given).

    ``fp8_out``: ``(q [N, I] e4m3, s [N, ceil(I/128)] fp32)`` written as well: ``h`` quantized per 1x128 tile in the
    same pass, bitwise ``quantize_1x128(h)`` (the FP8 down GEMM's input with no pass of its own). ``keep_h=False``
    (with ``fp8_out``): ``h`` itself is not written (nothing else needs it) and None is returned.
    """
    _check_rows(gu, "gu")
    n, inter = gu.shape[0], gu.shape[1] // 2
    if not keep_h and fp8_out is None:
        raise ValueError("keep_h=False leaves swiglu_fwd_triton nothing to write: give fp8_out")
    if keep_h:
        out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device) if out is None else out
        _check_rows(out, "out")
    if fp8_out is not None:
        _check_fp8_out(fp8_out, n, inter)
    h = out if keep_h else gu  # unwritten stand-in of h's dtype when not kept
    q, s = fp8_out if fp8_out is not None else (gu, w)  # unused stand-ins
    if n and inter:
        grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(inter, BLOCK_COLS))
        _swiglu_fwd_kernel[grid](gu, w.contiguous(), h, q, s, n, inter, gu.stride(0), h.stride(0), q.stride(0),
                                 s.stride(0), s.stride(-1), float(limit), BM=BLOCK_ROWS, BN=BLOCK_COLS,
                                 WRITE_H=keep_h, QUANT=fp8_out is not None, FP8MAX=FP8_MAX, BY_HAND=interpreting())
    return out if keep_h else None


def swiglu_bwd_triton(gu: Tensor, w: Tensor, dh: Tensor, limit: float,
                      out: tuple[Tensor | None, Tensor, Tensor] | None = None,
                      fp8_out: tuple[Tensor, Tensor] | None = None,
                      keep_dgu: bool = True, keep_h: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """Triton :func:`~csattn.ops.moe.naive.swiglu_bwd_ref`: ``gu [N, 2I]``, ``w [N]``, ``dh [N, I]`` ->
    ``dgu [N, 2I]``, ``h [N, I]`` (weighted, recomputed), ``dw [N]`` fp32. ``out`` optionally gives the three
    destinations.

    ``fp8_out``: ``(q [N, 2I] e4m3, s [N, 2I/128] fp32)`` written as well: ``dgu`` quantized per 1x128 tile in the
    same pass, bitwise ``quantize_1x128(dgu)`` (``I`` a multiple of 128: each half starts on a tile).
    ``keep_dgu=False`` (with ``fp8_out``): ``dgu`` itself is not written and None is returned in its place;
    ``keep_h=False``: ``h`` likewise (it serves the down projection's weight and LoRA gradients only).
    """
    _check_rows(gu, "gu")
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    n, inter = gu.shape[0], gu.shape[1] // 2
    if not keep_dgu and fp8_out is None:
        raise ValueError("keep_dgu=False leaves swiglu_bwd_triton's dgu nowhere: give fp8_out")
    if fp8_out is not None and inter % BLOCK_COLS:
        raise ValueError(f"fp8_out needs I % {BLOCK_COLS} == 0 (each half of dgu starts on a 1x128 tile), "
                         f"got I {inter}")
    if out is None:
        dgu = torch.empty_like(gu, memory_format=torch.contiguous_format) if keep_dgu else None
        h = torch.empty((n, inter), dtype=gu.dtype, device=gu.device) if keep_h else None
        dw = torch.empty((n,), dtype=torch.float32, device=gu.device)
    else:
        dgu, h, dw = out
        dgu, h = (dgu if keep_dgu else None), (h if keep_h else None)
    if dgu is not None:
        _check_rows(dgu, "dgu")
    if h is not None:
        _check_rows(h, "h")
    if fp8_out is not None:
        _check_fp8_out(fp8_out, n, 2 * inter)
    d = dgu if dgu is not None else gu  # unwritten stand-ins of dgu's and h's dtype when not kept
    hk = h if h is not None else dh
    q, s = fp8_out if fp8_out is not None else (gu, w)  # unused stand-ins
    if n:
        if not inter:
            dw.zero_()
        else:
            blocks = 1 if fp8_out is None else triton.cdiv(inter, BLOCK_COLS)  # see the kernel
            dwp = dw.unsqueeze(1) if blocks == 1 else torch.empty((n, blocks), dtype=torch.float32, device=gu.device)
            _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK_ROWS), blocks)](
                gu, w.contiguous(), dh, d, hk, dwp, q, s, n, inter, gu.stride(0), dh.stride(0), d.stride(0),
                hk.stride(0), q.stride(0), s.stride(0), s.stride(-1), dwp.stride(0), float(limit), BM=BLOCK_ROWS,
                BN=BLOCK_COLS, WRITE_DGU=dgu is not None, WRITE_H=h is not None, QUANT=fp8_out is not None,
                FP8MAX=FP8_MAX, BY_HAND=interpreting())
            if blocks > 1:
                torch.sum(dwp, dim=1, out=dw)
    return dgu, h, dw


def gather_sum_triton(src: Tensor, inv: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """Triton :func:`~csattn.ops.moe.naive.gather_sum_ref`: ``src [N, D]``, ``inv [N]`` -> ``[N / k, D]``."""
    _check_rows(src, "src")
    t, d = inv.shape[0] // max(k, 1), src.shape[1]
    out = torch.empty((t, d), dtype=src.dtype, device=src.device) if out is None else out
    _check_rows(out, "out")
    if t and d:
        bd = min(256, triton.next_power_of_2(d))
        grid = (triton.cdiv(t, 8), triton.cdiv(d, bd))
        _gather_sum_kernel[grid](src, inv.contiguous(), out, t, d, src.stride(0), out.stride(0),
                                 K=k, BT=8, BD=bd)
    return out
